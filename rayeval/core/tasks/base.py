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
to a backend (``core.backends``) and turns the responses into the metrics' outputs. What they
call on a batch's rows and a data set's columns is ``rows`` (its names re-exported here).
"""

from __future__ import annotations

from typing import ClassVar, Mapping

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.dataset as pads

from rayeval.io import data
from rayeval.core import prepared, samples, stats
from rayeval.config.schema import DatasetSpec
from rayeval.errors import CheckpointError, DataError, ModelError
from rayeval.config.registry import Registry
from rayeval.core import metrics as _metrics
from rayeval.core.metrics import IGNORE
from rayeval.core.backends.base import Backend, Context, Inputs, wrong_output
# What the tasks call on a batch's rows and a data set's columns (``rows``); named here too, where
# the package, the pipeline's transform stage and the tests take them from.
from rayeval.core.tasks.rows import (SCAN_LIMIT_BYTES, Recorded, _check_finite,  # noqa: F401
                                     _column_bytes, _min_max, _raise_if_not_finite, _words,
                                     check_finite_inputs, inputs_of, map_inputs, nbytes, pin,
                                     rows_of, take, transformed, concat)
from rayeval.lazy import lazy_module

torch = lazy_module("torch")        # imported on first use (rayeval.lazy)

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
    keeps_records: ClassVar[bool] = False  # per-item records, by default (EvalSpec.samples)

    def only_generates(self, spec) -> bool:
        """Whether evaluation ``spec`` (an EvalSpec) only generates: nothing runs the
        model's own forward (a vLLM engine then holds the weights on its own)."""
        return self.generates

    def pass_service(self, spec, device, model_spec):
        """What one pass of evaluation ``spec`` (an EvalSpec) needs running beside the model
        on a worker, with ``start()`` (before the pass: an error fails the cell) and
        ``close()`` (always, after it); None: nothing (an lmms-eval task's served judge).
        Rank 0 starts one again around the task's own aggregation of a cell's records
        (``workers.sinks.Publish``): the task's code may ask it there too."""
        return None

    def row_positions(self, spec) -> bool:
        """Whether evaluation ``spec``'s (an EvalSpec) per-item records name each item by its
        row: where they are kept and its data has no id column (the item's id is then a
        64-bit hash of its content, for the bootstrap, which no user can look up). The
        readers then add each row's position in the data set (``io.data.ROW``)."""
        return bool(spec.samples) and spec.dataset.id is None

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

    def limited_from(self, spec) -> int | None:
        """The task's whole item count when the evaluation scores only its first items (an
        entry's ``limit:``), else None: the stored cell says n of N."""
        return None

    def scored_units(self, states: Mapping[str, torch.Tensor]) -> int | None:
        """How many units were scored, from a cell's merged states, when that is not the row
        count (language modeling: unmasked target tokens); None when the rows are the units."""
        return None

    def item_records(self, x, out: torch.Tensor) -> dict[str, list]:
        """Each scored item's record, a list per column (tasks that ``keeps_records``)."""
        raise NotImplementedError

    def own_aggregations(self, spec, keys: list[str], records, bootstrap) -> dict:
        """{key: ``MetricResult``} of the metrics ``keys`` that the task aggregates with its
        own function over every item (lm-eval's and lmms-eval's: ``harness.items``), from the
        cell's per-item ``records`` (a pyarrow table, every worker's) read back once the
        cell is scored; ``bootstrap``: the evaluation's."""
        raise NotImplementedError(f"task {self.name!r} has no metric of its own aggregation")


@TASKS.register(instance=True)
class Classification(Task):
    name = "classification"
    needs = "logits of shape (batch, classes)"
    keeps_records = True

    def decode(self, table, spec, shapes, transform=None, decoder=None):
        x, y = super().decode(table, spec, shapes, transform, decoder)
        if getattr(decoder, "samples", False):
            x = Recorded(x, self.item_fields(table, spec, x, y))
        return x, y

    def item_fields(self, table, spec, x, y) -> dict[str, list]:
        """What an item's record shows of its row: its id (the id column's value, else the
        content id the bootstrap uses), its class as text (as every record holds a target),
        and where an input column holds encoded images, their thumbnails (made on the Ray
        Data stage that ran the transform, when one did: the images stayed there)."""
        if spec.id is not None:
            ids = data.column_array(table, spec.id).to_pylist()
        else:
            ids = self.row_ids(table, spec, x, y).tolist()
        fields = {"id": ids, "target": [str(c) for c in y.tolist()], **data.positions(table)}
        thumbs = prepared.thumbnails(table) if prepared.is_prepared(table) else \
            samples.image_thumbnails(table, spec)
        if thumbs is not None:
            fields["thumbnails"] = thumbs
        return fields

    def row_ids(self, table, spec, x, y):
        if isinstance(x, Recorded) and spec.id is None:     # hashed once, for the records
            return torch.tensor(x.items["id"], dtype=torch.int64)
        return super().row_ids(table, spec, inputs_of(x), y)

    def score(self, backend, x, y, ctx):
        return super().score(backend, inputs_of(x), y, ctx)

    def probe_input(self, x):
        return inputs_of(x)

    def item_records(self, x, out):
        """Each item's fields (``item_fields``), the class it was given as text (the arg-max,
        as ``accuracy`` takes it) and that class's ``probability`` (the softmax in float64,
        as ``ece`` and ``brier`` compute it).

        The probability of the predicted class only, not a vector over every class, even a
        few: what the pages show of an item is the prediction, how sure the model was and the
        target (the confusion matrix's cells, the most confident mistakes); the target's own
        probability is exp(-nll) where ``nll`` is listed. The digits example's record files
        (4 checkpoints x 3,012 items, 10 classes, with ``accuracy`` and ``nll``) take 330 KB,
        27 bytes an item; a float64 vector of its 10 classes added 98 bytes an item (float64
        probabilities hardly compress), 4.6 times the files, and ImageNet's 1,000 classes
        would add 8 KB an item."""
        records = dict(x.items) if isinstance(x, Recorded) else {}
        pred = out.argmax(dim=1)
        prob = torch.softmax(out.to(torch.float64), dim=1).gather(1, pred.view(-1, 1))
        records["response"] = [str(c) for c in pred.tolist()]
        records["probability"] = prob.view(-1).tolist()
        return records

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
