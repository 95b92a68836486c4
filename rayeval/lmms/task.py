"""lmms-eval tasks: the worker's half (the driver's is ``render``).

A row is one document of an lmms-eval task, rendered on the driver (``requests.py``): its chat
as JSON, its images as PNG bytes, the target. The task is the image ``generation`` task
(``core.tasks.vision``) with two changes:

- the prompt is the document's chat templated by the checkpoint's processor
  (``apply_chat_template(messages, add_generation_prompt=True)``, what lmms-eval's
  ``huggingface`` model does), not a question wrapped in one user turn; the images are decoded
  and run through the processor on the same CPU stage as for any image item;
- the generated texts are scored by lmms-eval's own filters and ``process_results``
  (``scoring.py``) with the task object the driver sent through Ray, into one float row of
  metric values per document, which the ``lm_mean`` metrics below sum exactly (a metric of
  the task's own aggregation: its values kept whole in the records, ``harness.items``); a judged
  task's judge is served on the worker's loopback while its pass runs (``judge_server``).
"""

from __future__ import annotations

from rayeval.core.tasks.vision import ImageGeneration
from rayeval.errors import DataError
from rayeval.harness import items, store
from rayeval.harness.task import check_request_table, own_results
from rayeval.io import data
from rayeval.lmms.requests import COLUMNS, context_of, decode_messages
from rayeval.lmms.scoring import score_documents


def lmms_task(data_location: str):
    """The lmms-eval task a request table was rendered from: the driver's own, or the one it
    sent this worker with the plan; never read from the store."""
    task = store.task_for(data_location)
    if task is None:
        raise DataError(f"{data_location}: the lmms-eval task rendered for these requests did "
                        "not come with the plan; run the sweep again to render it")
    return task


class TemplatedChats:
    """A ``Processor`` whose ``render`` templates a row's chat (JSON messages) instead of
    wrapping a question in one user turn; everything else is the processor's."""

    def __init__(self, processor):
        self._processor = processor

    def __getattr__(self, name):
        return getattr(self._processor, name)

    def render(self, messages_json: str, images: int) -> str:
        messages = decode_messages(messages_json)
        placeholders = sum(part.get("type") == "image" for m in messages for part in m["content"])
        if placeholders != images:
            raise DataError(f"a document's chat has {placeholders} image placeholders for "
                            f"{images} images; render the lmms-eval task again")
        return self._processor.processor.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=True)


class LmmsEval(ImageGeneration):
    name = "lmms_eval"
    needs_target = False

    def spec_problem(self, spec):
        return None

    def row_positions(self, spec) -> bool:
        return False            # a record's id is lmms-eval's doc_id: the document's position

    def check_schema(self, spec, schema):
        check_request_table(spec, schema, COLUMNS, "lmms-eval")
        super().check_schema(spec, schema)

    def tokenize(self, table, spec, tok, decoder):
        return super().tokenize(table, spec, TemplatedChats(tok), decoder)

    def limited_from(self, spec) -> int | None:
        """As ``harness.task.Harness.limited_from``: the task's document count where the
        entry's ``limit:`` scored only the first ones; None: every document."""
        return store.limited_from(spec.dataset.path)

    def row_ids(self, table, spec, x, y):
        return data.id_values(table, "doc_id", f"{spec.key_path}.doc_id")

    def item_fields(self, table, spec):
        chats = data.column_array(table, "messages").to_pylist()
        fields = super().item_fields(table, spec)
        fields["context"] = [context_of(decode_messages(c)) for c in chats]
        # The images' references are the request table's own PNG bytes ("<225 bytes>"): the
        # record's id (lmms-eval's doc_id) names the document instead.
        fields.pop("images", None)
        return fields

    def pass_service(self, spec, device, model_spec):
        """A judged task's judge (``judge: {model: ...}``), served on this worker's loopback
        while the pass runs (``judge_server``; docs/lmms-judges.md)."""
        if spec.judge is None or spec.judge.staged:
            return None
        from rayeval.lmms.judge_server import PassJudge

        return PassJudge(spec, device, model_spec)

    def score(self, backend, x, y, ctx):
        texts = backend.generate_images(x.requests(), x.ids, ctx)
        rows, x.responses, x.values = score_documents(lmms_task(ctx.spec.path), x.ids, texts,
                                                      ctx.spec.key_path)
        x.repeats = None
        return rows, y

    def item_records(self, x, out):
        records = super().item_records(x, out)
        if getattr(x, "values", None) is not None:
            records[items.VALUES] = list(x.values)
        return records

    def own_aggregations(self, spec, keys, records, bootstrap):
        import lmms_eval.api.metrics as lmms_metrics

        from rayeval.lmms.requests import AGGREGATIONS

        return own_results(lmms_task(spec.dataset.path), keys, records, bootstrap,
                           lmms_metrics, AGGREGATIONS, spec.key_path)
