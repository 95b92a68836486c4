"""The text tasks of language models, scored as lm-evaluation-harness scores them.

    multiple_choice   each choice scored by the summed log-likelihood of ``delimiter + choice``
                      after the prompt; acc / acc_norm (per character of the choice)
    text_perplexity   each document scored with disjoint rolling windows of the model's
                      context; perplexity per token, word and byte, bits per byte
    generation        greedy decoding until a stop string, the end-of-sequence token or
                      ``max_new_tokens``; exact match with the target, both stripped

A row is one item (a question with all its choices, a document with all its windows, a
prompt): it is counted once and its bootstrap weight comes from its id. What the harness's
users' numbers depend on is reproduced here: context and continuation encoded together and
split at the context's token count, trailing spaces of the context moved to the continuation,
long inputs cut from the left, windows conditioned on the BOS (else EOS) token, words as
``re.split(r"\\s+")`` pieces and bytes of UTF-8.

A decoded batch is a ``TextBatch`` of token lists (tokenized once per tokenizer: a worker keeps
its decoded shard across checkpoints that share one). Scoring hands its requests to the
backend (log-likelihoods of token pairs, or generations: ``core.backends``) and turns the
responses into one small float row per item, which the metrics in metrics.py reduce into exact states:

    multiple_choice   (rows, choices, 2): log-likelihood, characters (padding: -inf, 1)
    text_perplexity   (rows, 4): log-likelihood, tokens, words, bytes
    generation        (rows,): 1.0 for an exact match
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass, field
from typing import ClassVar

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from rayeval.io import data
from rayeval.core import prepared
from rayeval.config.schema import DatasetSpec
from rayeval.errors import DataError
from rayeval.core.tasks.base import TASKS, TOKENS, Task


@dataclass
class TextBatch:
    """A batch of items as token lists (one entry per row) and what scoring needs of them.
    ``items``: what each item's record shows (id, context, target, choices), kept only when
    the evaluation keeps per-item records; ``responses``: the generated texts, once scored."""
    rows: list
    extra: list = field(default_factory=list)
    nbytes: int = 0
    items: dict | None = None
    responses: list | None = None
    ids: list | None = None        # row ids (generation: each item's sampling seed)
    repeats: list | None = None    # every generation of each item, when sampled repeatedly


def _is_text(typ: pa.DataType) -> bool:
    return pa.types.is_string(typ) or pa.types.is_large_string(typ)


def _is_text_list(typ: pa.DataType) -> bool:
    return (pa.types.is_list(typ) or pa.types.is_large_list(typ)) and _is_text(typ.value_type)


class TextTask(Task):
    """The base of tasks whose rows are text: a tokenizer turns them into requests (token
    pairs, windows, prompts) that a backend answers; a subclass names the columns it reads."""
    needs = "logits of shape (batch, positions, vocab): a causal language model"
    needs_inputs = False
    uses_text = True
    keeps_records = True
    group_rows = 1024        # items scored together: their requests are batched by length
    reads: ClassVar[tuple[str, ...]] = ()      # the dataset keys of its text columns

    def spec_problem(self, spec: DatasetSpec):
        used = ", ".join(f"dataset.{k}" for k in self.reads)
        if spec.inputs:
            return "inputs", f"task {self.name} reads {used}, not inputs"
        if spec.transform:
            return "transform", f"task {self.name} reads {used}; it takes no transform"
        for key in self.reads:
            if getattr(spec, key) is None:
                return key, f"missing required key: task {self.name} reads {used}"
        for key in ("prompt", "choices", "text"):
            if key not in self.reads and getattr(spec, key) is not None:
                return key, f"task {self.name} does not read a {key} column (it reads {used})"
        if self.name != "multiple_choice" and spec.delimiter != " ":
            return "delimiter", "only multiple_choice puts a delimiter before each choice"
        return None

    def check_schema(self, spec, schema):
        for key in self.reads:
            column = getattr(spec, key)
            typ = schema.field(column).type
            want = _is_text_list(typ) if key == "choices" else _is_text(typ)
            if not want:
                what = "lists of strings" if key == "choices" else "strings"
                raise DataError(f"{spec.key_path}.{key}: column {column!r} has type {typ}; "
                                f"task {self.name} needs {what}")

    def input_shapes(self, ds, spec):
        return {}

    def check_values(self, ds, spec, size):
        columns = [getattr(spec, k) for k in self.reads]
        table = ds.to_table(columns=list(dict.fromkeys(
            columns + [c for c in (spec.target, spec.id) if c])))
        for key, column in zip(self.reads, columns):
            _no_nulls(table, column, f"{spec.key_path}.{key}", spec)
        self.check_table(table, spec)

    def check_table(self, table, spec) -> None:
        """Task-specific checks of the whole data set (the driver) or a batch (a worker)."""

    def row_ids(self, table, spec, x, y):
        if spec.id is not None:
            return data.id_values(table, spec.id, f"{spec.key_path}.id")
        columns = [getattr(spec, k) for k in self.reads] + ([spec.target] if spec.target else [])
        values = [data.column_array(table, c).to_pylist() for c in columns]
        return torch.tensor([_content_id(row) for row in zip(*values)], dtype=torch.int64)

    def join(self, xs: list[TextBatch]) -> TextBatch:
        items = None
        if all(x.items is not None for x in xs):
            items = {k: [v for x in xs for v in x.items[k]] for k in xs[0].items}
        ids = [i for x in xs for i in x.ids] if all(x.ids is not None for x in xs) else None
        return TextBatch([r for x in xs for r in x.rows], [e for x in xs for e in x.extra],
                         sum(x.nbytes for x in xs), items, ids=ids)

    # --- per-item records ------------------------------------------------------------------

    def item_fields(self, table, spec) -> dict[str, list]:
        """What an item's record shows of its row: its id (the id column's value, else the
        content id the bootstrap uses), the context the model saw (text before tokens) and
        the target as text."""
        if spec.id is not None:
            ids = data.column_array(table, spec.id).to_pylist()
        else:
            ids = self.row_ids(table, spec, None, None).tolist()
        context = data.column_array(table, getattr(spec, self.reads[0])).to_pylist()
        return {"id": ids, "context": context, "target": self.target_texts(table, spec),
                **data.positions(table)}

    def target_texts(self, table, spec) -> list:
        return [None] * table.num_rows

    def item_records(self, x: TextBatch, out: torch.Tensor) -> dict[str, list]:
        """Each scored item's record (see ``item_fields``) with what the model gave it:
        ``response`` (the chosen choice or the generated text) and ``loglikelihoods``."""
        raise NotImplementedError

    def probe_input(self, x: TextBatch) -> torch.Tensor:
        return torch.tensor([self.first_tokens(x)[:16]], dtype=torch.int64)

    def idle_input(self, spec, shapes):
        return torch.zeros((1, 1), dtype=torch.int64)         # one token

    def first_tokens(self, x: TextBatch) -> list[int]:
        raise NotImplementedError

    def output_size(self, out):
        if isinstance(out, torch.Tensor) and out.dim() == 3:
            return int(out.shape[2])
        raise self.wrong_output(out)

    def decode(self, table, spec, shapes, transform=None, decoder=None):
        tok = getattr(decoder, "text", None)
        if tok is None:
            raise RuntimeError(f"task {self.name} decoded without a tokenizer (a bug)")
        for key in self.reads:
            _no_nulls(table, getattr(spec, key), f"{spec.key_path}.{key}", spec)
        self.check_table(table, spec)
        done = prepared.text_rows(table, tok.key)       # tokenized on a Ray Data stage
        x = TextBatch(*done) if done is not None else self.tokenize(table, spec, tok, decoder)
        if getattr(decoder, "samples", False):
            x.items = self.item_fields(table, spec)
            x.nbytes += sum(len(str(v)) for column in x.items.values() for v in column)
        return x, self.targets(table, spec)

    def targets(self, table, spec):
        return torch.zeros(table.num_rows, dtype=torch.int64)

    def tokenize(self, table, spec, tok, decoder) -> TextBatch:
        raise NotImplementedError

    def prepared_table(self, table, x: TextBatch, key: str, pixels: bool = True,
                       records: bool = False):
        """What a Ray Data stage hands the worker: the table with the tokenized rows
        (``pixels`` and ``records`` are for image items: ``ImageItems.prepared_table``)."""
        return prepared.attach_text(table, x.rows, x.extra, key)


# Registered with its image path (vision.py, imported when first asked for), in this order.
TASKS.add_lazy("multiple_choice", "rayeval.core.tasks.vision:ImageMultipleChoice",
               instance=True)


class MultipleChoice(TextTask):
    """The text path; ``vision.ImageMultipleChoice`` adds images and is the registered one."""
    name = "multiple_choice"
    reads = ("prompt", "choices")

    def check_schema(self, spec, schema):
        super().check_schema(spec, schema)
        typ = schema.field(spec.target).type
        if not pa.types.is_integer(typ):
            raise DataError(f"{spec.key_path}.target: column {spec.target!r} has type {typ}; "
                            "expected the index of the right choice (an integer)")

    def check_table(self, table, spec):
        choices = data.column_array(table, spec.choices)
        counts = pc.list_value_length(choices).to_numpy(zero_copy_only=False)
        if choices.flatten().null_count:
            _fail_at(table, spec, ~np.asarray(pc.is_valid(choices.flatten()).to_numpy(
                zero_copy_only=False)), f"{spec.key_path}.choices: a null choice", counts)
        _fail_at(table, spec, counts == 0, f"{spec.key_path}.choices: no choices")
        _no_nulls(table, spec.target, f"{spec.key_path}.target", spec)
        labels = data.column_array(table, spec.target).to_numpy(zero_copy_only=False)
        bad = (labels < 0) | (labels >= counts)
        if bad.any():
            i = int(np.flatnonzero(bad)[0])
            raise DataError(f"{spec.key_path}.target: {_row(table, spec, i)} has answer "
                            f"{int(labels[i])}, outside its {int(counts[i])} choices "
                            f"[0, {int(counts[i])}); fix the label (an index into choices)")

    def targets(self, table, spec):
        return data.target_tensor(table, spec.target, f"{spec.key_path}.target")

    def item_fields(self, table, spec):
        fields = super().item_fields(table, spec)
        fields["choices"] = data.column_array(table, spec.choices).to_pylist()
        return fields

    def target_texts(self, table, spec):
        choices = data.column_array(table, spec.choices).to_pylist()
        labels = data.column_array(table, spec.target).to_pylist()
        return [options[label] for options, label in zip(choices, labels)]

    def item_records(self, x, out):
        records = dict(x.items)
        lls = [[float(v) for v in row[:len(pairs), 0].tolist()]
               for row, pairs in zip(out, x.rows)]
        best = [max(range(len(v)), key=lambda j, v=v: (v[j], -j)) for v in lls]
        records["response"] = [opts[b] for opts, b in zip(x.items["choices"], best)]
        records["loglikelihoods"] = lls
        return records

    def tokenize(self, table, spec, tok, decoder):
        prompts = data.column_array(table, spec.prompt).to_pylist()
        choices = data.column_array(table, spec.choices).to_pylist()
        rows, extra, n = [], [], 0
        for i, (prompt, options) in enumerate(zip(prompts, choices)):
            pairs = [tok.encode_pair(prompt, spec.delimiter + c) for c in options]
            for ctx, cont in pairs:
                if not cont:
                    raise DataError(f"{spec.key_path}.choices: {_row(table, spec, i)} has a "
                                    "choice that encodes to no tokens; give it some text")
                if len(cont) > tok.max_length:
                    raise DataError(f"{spec.key_path}.choices: {_row(table, spec, i)} has a "
                                    f"choice of {len(cont)} tokens, longer than the model's "
                                    f"context of {tok.max_length}")
                n += 8 * (len(ctx) + len(cont))
            rows.append(pairs)
            extra.append([float(len(c)) for c in options])
        return TextBatch(rows, extra, n)

    def first_tokens(self, x):
        ctx, cont = x.rows[0][0]
        return ctx + cont

    def score(self, backend, x, y, ctx):
        requests = [pair for pairs in x.rows for pair in pairs]
        lls = [ll for ll, _ in backend.loglikelihood(requests, ctx)]
        width = max(len(p) for p in x.rows)
        out = torch.zeros((len(x.rows), width, 2), dtype=torch.float64)
        out[:, :, 0] = float("-inf")
        out[:, :, 1] = 1.0
        k = 0
        for i, (pairs, chars) in enumerate(zip(x.rows, x.extra)):
            out[i, :len(pairs), 0] = torch.tensor(lls[k:k + len(pairs)], dtype=torch.float64)
            out[i, :len(pairs), 1] = torch.tensor(chars, dtype=torch.float64)
            k += len(pairs)
        return out, y


@TASKS.register(instance=True)
class TextPerplexity(TextTask):
    name = "text_perplexity"
    reads = ("text",)
    needs_target = False
    counts_tokens = True

    def tokenize(self, table, spec, tok, decoder):
        texts = data.column_array(table, spec.text).to_pylist()
        rows, extra, n = [], [], 0
        for text in texts:
            tokens = tok.encode(text)
            windows = rolling_windows(tokens, tok.prefix_id, tok.max_length)
            rows.append(windows)
            extra.append((float(len(tokens)), float(len(re.split(r"\s+", text))),
                          float(len(text.encode("utf-8")))))
            n += 16 * len(tokens) + 8 * len(windows)
        return TextBatch(rows, extra, n)

    def first_tokens(self, x):
        for windows in x.rows:
            if windows:
                ctx, cont = windows[0]
                return ctx + cont
        return [0]

    def score(self, backend, x, y, ctx):
        # the windows' log-likelihoods summed here, in window order (not loglikelihood_rolling's
        # exact sum): the numbers this task has always published
        requests = [w for windows in x.rows for w in windows]
        lls = [ll for ll, _ in backend.loglikelihood(requests, ctx)]
        out = torch.zeros((len(x.rows), 4), dtype=torch.float64)
        k = 0
        for i, (windows, (tokens, words, nbytes)) in enumerate(zip(x.rows, x.extra)):
            out[i, 0] = sum(lls[k:k + len(windows)])      # float64, in window order
            out[i, 1:] = torch.tensor([tokens, words, nbytes], dtype=torch.float64)
            k += len(windows)
        return out, y

    def item_records(self, x, out):
        records = dict(x.items)
        records["loglikelihoods"] = [[float(v)] for v in out[:, 0].tolist()]
        records["tokens"] = [int(v) for v in out[:, 1].tolist()]
        return records

    def scored_tokens(self, outputs, targets):
        return int(outputs[:, 1].sum().item())

    def scored_units(self, states):
        return int(states[TOKENS])


TASKS.add_lazy("generation", "rayeval.core.tasks.vision:ImageGeneration", instance=True)
# Its judged metrics (``judge``; docs/judges.md) are registered with it.
from rayeval.core import judge as _judge  # noqa: E402,F401
from rayeval.lazy import lazy_module

torch = lazy_module("torch")        # imported on first use (rayeval.lazy)


class Generation(TextTask):
    """The text path; ``vision.ImageGeneration`` adds images and is the registered one."""
    name = "generation"
    reads = ("prompt",)
    generates = True

    def check_schema(self, spec, schema):
        super().check_schema(spec, schema)
        typ = schema.field(spec.target).type
        if not _is_text(typ):
            raise DataError(f"{spec.key_path}.target: column {spec.target!r} has type {typ}; "
                            "generation compares with a string answer")

    def check_table(self, table, spec):
        _no_nulls(table, spec.target, f"{spec.key_path}.target", spec)

    def target_texts(self, table, spec):
        return data.column_array(table, spec.target).to_pylist()

    def item_records(self, x, out):
        records = dict(x.items)
        records["response"] = list(x.responses)
        if x.repeats is not None:
            records["responses"] = list(x.repeats)
        return records

    def tokenize(self, table, spec, tok, decoder):
        budget = tok.max_length - decoder.generation.max_new_tokens
        if budget < 1:
            raise DataError(f"{spec.key_path}: generation.max_new_tokens "
                            f"{decoder.generation.max_new_tokens} leaves no room for a prompt "
                            f"in the model's context of {tok.max_length}; lower it")
        prompts = data.column_array(table, spec.prompt).to_pylist()
        answers = data.column_array(table, spec.target).to_pylist()
        rows = [tok.encode(p)[-budget:] for p in prompts]
        return TextBatch(rows, answers, sum(8 * len(r) for r in rows),
                         ids=self.row_ids(table, spec, None, None).tolist())

    def first_tokens(self, x):
        return x.rows[0] or [0]

    def score(self, backend, x, y, ctx):
        """Exact match; with ``repeats`` k, the mean over the item's k generations."""
        texts = backend.generate(x.rows, x.ids, ctx)
        x.responses = [t[0] for t in texts]
        x.repeats = texts if ctx.generation.repeats > 1 else None
        hit = [sum(float(g.strip() == str(a).strip()) for g in t) / len(t)
               for t, a in zip(texts, x.extra)]
        return torch.tensor(hit, dtype=torch.float64), y


# --- requests ---------------------------------------------------------------------------------

def rolling_windows(tokens: list[int], prefix: int, max_length: int
                    ) -> list[tuple[list[int], list[int]]]:
    """Disjoint windows that predict every token once: the first conditioned on the prefix
    token, each later one on the tokens before it, up to ``max_length`` inputs."""
    if not tokens:
        return []
    first = min(max_length, len(tokens))
    windows = [([prefix], tokens[:first])]
    done = first
    while done < len(tokens):
        n = min(len(tokens) - done, max_length)
        end = done + n
        context = tokens[max(0, end - max_length - 1):end - 1]
        windows.append((context[:len(context) - (n - 1)], tokens[end - n:end]))
        done = end
    return windows


# --- data checks -----------------------------------------------------------------------------

def _content_id(values: tuple) -> int:
    blob = json.dumps(values, ensure_ascii=False, default=str).encode("utf-8")
    return int.from_bytes(hashlib.blake2b(blob, digest_size=8).digest(), "little", signed=True)


def _row(table, spec: DatasetSpec, i: int) -> str:
    if spec.id is not None:
        return f"the row with {spec.id} = {data.column_array(table, spec.id)[i].as_py()!r}"
    return f"row {i} of a batch (set {spec.key_path}.id to name it)"


def _fail_at(table, spec, bad, what: str, counts=None) -> None:
    """A DataError naming the first row flagged by ``bad`` (per row, or per choice when
    ``counts`` gives each row's number of choices)."""
    bad = np.asarray(bad, dtype=bool)
    if not bad.any():
        return
    first = int(np.flatnonzero(bad)[0])
    if counts is not None:
        first = int(np.searchsorted(np.cumsum(counts), first, side="right"))
    raise DataError(f"{what} in {_row(table, spec, first)}; fix or drop it")


def _no_nulls(table, column: str, key: str, spec) -> None:
    arr = data.column_array(table, column)
    if arr.null_count:
        _fail_at(table, spec, ~np.asarray(pc.is_valid(arr).to_numpy(zero_copy_only=False)),
                 f"{key}: a null value in column {column!r}")

