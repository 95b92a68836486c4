"""lmms-eval tasks: the worker's half (the driver's is ``render``).

A row is one document of an lmms-eval task, rendered on the driver (``requests.py``): its chat
as JSON, its images as PNG bytes, the target. The task is the image ``generation`` task
(``core.tasks.vision``) with two changes:

- the prompt is the document's chat templated by the checkpoint's processor
  (``apply_chat_template(messages, add_generation_prompt=True)``, what lmms-eval's
  ``huggingface`` model does), not a question wrapped in one user turn; the images are decoded
  and run through the processor on the same CPU stage as for any image item;
- a ``multiple_choice`` task's document is scored as lmms-eval's ``llava_hf`` model scores
  its requests (``choice_texts``, ``HFBackend.choice_losses``): each choice's text is the
  tokenizer's chat template over a user turn (one ``<image>`` per image, a newline, the
  context) and the assistant's continuation; the model's mean loss over its tokens after the
  prompt's (the prompt counted as the processor tokenizes it without images), and lmms-eval's
  ``process_results`` picks the choice with the lowest;
- the generated texts are scored by lmms-eval's own filters and ``process_results``
  (``scoring.py``) with the task object the driver sent through Ray, into one float row of
  metric values per document, which the ``lm_mean`` metrics below sum exactly (a metric of
  the task's own aggregation: its values kept whole in the records, ``harness.items``); a judged
  task's judge is served on the worker's loopback while its pass runs (``judge_server``).
"""

from __future__ import annotations

from rayeval.core.tasks.text import _row
from rayeval.core.tasks.vision import ImageGeneration
from rayeval.errors import DataError
from rayeval.harness import items, store
from rayeval.harness.task import check_request_table, own_results
from rayeval.io import data, images as image_io
from rayeval.lmms.requests import COLUMNS, context_of, decode_messages
from rayeval.lmms.scoring import repeats_of, score_documents
from rayeval.lazy import lazy_module

torch = lazy_module("torch")        # imported on first use (rayeval.lazy)


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


# lmms-eval's llava_hf puts this in a choice's user turn for each image (DEFAULT_IMAGE_TOKEN).
IMAGE_TOKEN = "<image>"


def choice_texts(tok, context: str, images: int, continuations: list[str]
                 ) -> tuple[str, list[str]]:
    """What lmms-eval's ``llava_hf`` renders for a document's choices: (the prompt: the user
    turn, one ``<image>`` per image joined by spaces, a newline, the context, with the
    generation prompt; each choice's text: the user turn and the assistant's continuation),
    through the chat template of the processor's tokenizer."""
    tokenizer = tok.processor.tokenizer
    if not getattr(tokenizer, "chat_template", None):
        raise DataError("the checkpoint's tokenizer has no chat template, which lmms-eval's "
                        "multiple_choice prompts are rendered with; save one with it")
    user = {"role": "user", "content": f"{' '.join([IMAGE_TOKEN] * images)}\n{context}"}
    prompt = tokenizer.apply_chat_template([user], tokenize=False, add_generation_prompt=True)
    texts = [tokenizer.apply_chat_template([user, {"role": "assistant", "content": c}],
                                           tokenize=False, add_generation_prompt=False)
             for c in continuations]
    return prompt, texts


def stacked(inputs: list[dict]) -> dict:
    """One document's choices' processor outputs as one: their ``input_ids`` right-padded
    into rows, ``attention_mask`` saying each row's length, the rest (the images' tensors,
    the same for every choice) from the first."""
    width = max(int(i["input_ids"].shape[1]) for i in inputs)
    ids = torch.zeros((len(inputs), width), dtype=torch.int64)
    mask = torch.zeros((len(inputs), width), dtype=torch.int64)
    for j, one in enumerate(inputs):
        n = int(one["input_ids"].shape[1])
        ids[j, :n] = one["input_ids"][0]
        mask[j, :n] = 1
    rest = {k: v for k, v in inputs[0].items() if k not in ("input_ids", "attention_mask")}
    return {"input_ids": ids, "attention_mask": mask, **rest}


class LmmsEval(ImageGeneration):
    name = "lmms_eval"
    needs_target = False

    def only_generates(self, spec) -> bool:
        return spec.dataset.choices is None        # a choice task runs the model's forward

    def spec_problem(self, spec):
        return None

    def row_positions(self, spec) -> bool:
        return False            # a record's id is lmms-eval's doc_id: the document's position

    def check_schema(self, spec, schema):
        check_request_table(spec, schema, COLUMNS, "lmms-eval")
        super().check_schema(spec, schema)

    def check_values(self, ds, spec, size):
        # A choice task's document may have no image (a text task); its images are the PNGs
        # rendering encoded from lmms-eval's own, in a table checked against that rendering.
        if spec.choices is None:
            super().check_values(ds, spec, size)

    def tokenize(self, table, spec, tok, decoder):
        if spec.choices is None:
            return super().tokenize(table, spec, TemplatedChats(tok), decoder)
        root = image_io.root_for(spec.path)
        columns = [data.column_array(table, c).to_pylist()
                   for c in (spec.prompt, spec.images, spec.choices)]
        prompts, pictures, inputs = [], [], []
        for i, (chat, cell, continuations) in enumerate(zip(*columns)):
            context = context_of(decode_messages(chat))      # the one text part: the context
            decoded = image_io.decode_cell(cell, root, _row(table, spec, i),
                                           f"{spec.key_path}.images") if cell else []
            prompt, texts = choice_texts(tok, context, len(decoded), continuations)
            prompts.append(prompt)
            pictures.append(decoded)
            inputs.append(stacked([tok.inputs(t, decoded) for t in texts]))
        return self.image_batch(table, spec, tok, prompts, pictures, inputs)

    def item_extra(self, table, spec, proc, prompts):
        """A choice task's (the prompt's tokens, which lmms-eval's llava_hf masks: the
        processor's tokens of the prompt without its images; the continuations) per
        document; a generation task's target."""
        if spec.choices is None:
            return super().item_extra(table, spec, proc, prompts)
        choices = data.column_array(table, spec.choices).to_pylist()
        masked = [int(proc.processor(text=[p], return_tensors="pt")["input_ids"].shape[1])
                  for p in prompts]
        return list(zip(masked, choices))

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
        task = lmms_task(ctx.spec.path)
        x.repeats = None
        if ctx.spec.choices is not None:
            found = backend.choice_losses([(r, masked) for r, (masked, _) in
                                           zip(x.requests(), x.extra)], ctx)
            rows, _, x.values = score_documents(task, x.ids, found, ctx.spec.key_path)
            # the record's response: the choice lmms-eval's argmin picks (the first of ties)
            x.responses = [conts[min(range(len(got)), key=lambda j, g=got: (g[j][0], j))]
                           .strip() for got, (_, conts) in zip(found, x.extra)]
            return rows, y
        texts = backend.generate_images(x.requests(), x.ids, ctx)
        # the task's repeats: each document's k answers (a greedy one k times, as lmms-eval's)
        k = repeats_of(task)
        answers = [t[0] if k == 1 else list(t) if len(t) == k else [t[0]] * k for t in texts]
        rows, x.responses, x.values = score_documents(task, x.ids, [[a] for a in answers],
                                                      ctx.spec.key_path)
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
