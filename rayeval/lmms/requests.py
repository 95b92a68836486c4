"""The request table of an lmms-eval task: what the result store keeps of it, as plain data.

One row per document of the task:

    doc_id    the document's index in the task's evaluation split (the bootstrap keys on it)
    messages  the chat lmms-eval's ``doc_to_messages`` gives for the document, as JSON in the
              Hugging Face form its ``huggingface`` model hands ``apply_chat_template``:
              ``[{"role", "content": [{"type": "image"}, {"type": "text", "text"}]}]``, each
              image a placeholder in prompt order
    images    the images ``doc_to_visual`` returned, in that order, encoded as PNG bytes
              (lossless: the decoded pixels are the ones lmms-eval hands its processor)
    context   the text of the messages (for the per-item record); for a ``multiple_choice``
              task, the context lmms-eval hands its model (``doc_to_text``, few-shot included)
    target    ``doc_to_target`` as text (for the record)
    choices   ``multiple_choice`` tasks only: each request's continuation, in lmms-eval's order
              (``target_delimiter`` + the choice)

Nothing in it is a pickle: a table read back from a shared store is data, never code; the
driver checks the stored bytes against its own rendering (``harness.store.check_stored``)
before a run reads it. The task object a worker scores with (filters, ``process_results``)
comes from the driver through Ray, as for lm-eval tasks.
"""

from __future__ import annotations

import json

import pyarrow as pa

from rayeval.harness.requests import filter_names, metric_layout  # noqa: F401 - re-exported

COLUMNS = ("doc_id", "messages", "images", "context", "target")
IMAGES = "images"
CHOICES = "choices"
# lmms-eval aggregation function name -> (rayeval metric over its per-document value, columns
# per document). Only means merge as sums (a sum and a count); any other aggregation (a
# median, a BLEU, a task's own ``*_aggregate_results``) is the task's own function over every
# item (``harness.items``).
AGGREGATIONS = {"mean": ("lm_mean", 1)}


def table_schema(choices: bool = False) -> pa.Schema:
    fields = [("doc_id", pa.int64()), ("messages", pa.string()),
              (IMAGES, pa.list_(pa.binary())), ("context", pa.string()), ("target", pa.string())]
    return pa.schema(fields + ([(CHOICES, pa.list_(pa.string()))] if choices else []))


def encode_messages(messages: list[dict]) -> str:
    return json.dumps(messages, sort_keys=True, ensure_ascii=False)


def decode_messages(encoded: str) -> list[dict]:
    return json.loads(encoded)


def context_of(messages: list[dict]) -> str:
    """The messages' text parts, in order: what the per-item record shows as the question."""
    return "\n".join(part["text"] for m in messages for part in m["content"]
                     if part.get("type") == "text")


def layout(task) -> list[tuple[str, str, int, bool]]:
    """(result key, rayeval metric, column, higher is better) of each metric of an lmms-eval
    task under each of its filters, in lmms-eval's order; keys as lm-eval's
    (``config.names``: ``metric`` or ``metric,filter``). The walk is lm-eval's
    (``harness.requests.metric_layout``) over lmms-eval's metrics module."""
    import lmms_eval.api.metrics as lmms_metrics

    return metric_layout(task, lmms_metrics, AGGREGATIONS)
