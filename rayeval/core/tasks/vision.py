"""Image+text items for vision-language models: the ``generation`` and ``multiple_choice`` tasks
with a ``dataset.images`` column (the same tasks without it are text.py's).

An item is a question (``dataset.prompt``) with one or more images (``dataset.images``). Its
prompt is rendered as lmms-eval's generic ``huggingface`` chat model renders it (one user
turn: the images, then the text; the processor's chat template with the generation prompt:
``chat_prompt``, from ``io.vision``: lmms-eval's task reuses it), then the images are decoded and the checkpoint's processor
makes the model's inputs for that item alone, so an item's inputs never depend on which items
share its batch. That work runs on a Ray Data CPU stage (``execution.pipeline.Tokenize``),
once per processor: the stage hands the worker typed columns (``prepared.attach_arrays``);
the worker only scores.

    generation        ``Backend.generate_images``; ``score_texts`` turns each item's generated
                      texts into its float row (exact match here; lmms-eval's task overrides it)
    multiple_choice   ``Backend.loglikelihood_images``: each choice's log-likelihood after the
                      item's prompt and images; acc / acc_norm as for text

Per-item records carry the row id (the source row: ``dataset.id``, else the content id), the
question, the images' references (their paths, or their size when the row holds bytes), the
target and the response.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np
import pyarrow as pa

from rayeval.core import prepared, samples
from rayeval.core.backends.base import ImageRequest
from rayeval.core.tasks.text import Generation, MultipleChoice, _content_id, _no_nulls, _row
from rayeval.errors import DataError
from rayeval.io import data, images as image_io
from rayeval.io.vision import chat_prompt, render_messages  # noqa: F401  (the one renderer)
from rayeval.lazy import lazy_module

torch = lazy_module("torch")        # imported on first use (rayeval.lazy)

PROMPT = "prompt"        # the rendered prompt's column name among the stage's strings


@dataclass
class ImageBatch:
    """Image+text items ready to score: each item's rendered prompt, its decoded images (RGB
    uint8 arrays), the processor's outputs for it alone, and what scoring needs beside them
    (``extra``: the answer, or the choices' continuation tokens and lengths)."""
    prompts: list
    images: list
    inputs: list
    extra: list
    nbytes: int = 0
    ids: list | None = None
    items: dict | None = None
    responses: list | None = None
    repeats: list | None = None
    thumbnails: list | None = None    # made on the stage when the pixels stay there

    @property
    def rows(self) -> list:
        return self.inputs

    def requests(self) -> list[ImageRequest]:
        return [ImageRequest(p, tuple(im), inp)
                for p, im, inp in zip(self.prompts, self.images, self.inputs)]


def join(xs: list[ImageBatch]) -> ImageBatch:
    items = None
    if all(x.items is not None for x in xs):
        items = {k: [v for x in xs for v in x.items[k]] for k in xs[0].items}
    ids = [i for x in xs for i in x.ids] if all(x.ids is not None for x in xs) else None
    thumbs = [t for x in xs for t in x.thumbnails] \
        if all(x.thumbnails is not None for x in xs) else None
    return ImageBatch([p for x in xs for p in x.prompts], [i for x in xs for i in x.images],
                      [i for x in xs for i in x.inputs], [e for x in xs for e in x.extra],
                      sum(x.nbytes for x in xs), ids, items, thumbnails=thumbs)


class ImageItems:
    """What both image tasks add to their text task (placed first in the MRO: each method
    takes the image path when ``dataset.images`` is set or the batch holds images, and hands
    everything else to the text task)."""
    takes_images = True

    # --- the data set, on the driver -------------------------------------------------------

    def check_schema(self, spec, schema):
        super().check_schema(spec, schema)
        if spec.images is None:
            return
        typ = schema.field(spec.images).type
        if not image_io.column_type_ok(typ):
            raise DataError(f"{spec.key_path}.images: column {spec.images!r} has type {typ}; "
                            "expected image bytes, path strings, {bytes, path} structs, or "
                            "lists of those")

    def check_values(self, ds, spec, size):
        super().check_values(ds, spec, size)
        if spec.images is None:
            return
        # Every item has an image and every image is readable, before Ray starts: PIL's
        # verify reads each file's structure (PNG chunk CRCs, truncation) without decoding
        # pixels. A stage or worker that decodes a bad image still fails with the same line.
        root = image_io.root_for(spec.path)
        columns = list(dict.fromkeys([spec.images] + ([spec.id] if spec.id else [])))
        offset = 0
        for batch in ds.to_batches(columns=columns, batch_size=1024):
            table = pa.Table.from_batches([batch])
            values = data.column_array(table, spec.images).to_pylist()
            for i, value in enumerate(values):
                image_io.decode_cell(value, root, self._where(table, spec, i, offset),
                                     f"{spec.key_path}.images", check_only=True)
            offset += table.num_rows

    @staticmethod
    def _where(table, spec, i: int, offset: int = 0) -> str:
        if spec.id is not None:
            return _row(table, spec, i)
        return f"row {offset + i} (set {spec.key_path}.id to name rows by id)"

    # --- a batch -------------------------------------------------------------------------

    def held_rows(self, spec) -> int:
        # Image items are scored batch by batch as they come, so the decoding of the next
        # ones goes on behind the scoring. Holding a text task's 1,024 rows made the scorer
        # wait for every row of a small shard to be decoded first (scripts/bench_vlm.py).
        return 0 if spec.images is not None else super().held_rows(spec)

    def decode(self, table, spec, shapes, transform=None, decoder=None):
        if spec.images is None:
            return super().decode(table, spec, shapes, transform, decoder)
        proc = getattr(decoder, "text", None)
        if getattr(proc, "processor", None) is None:
            raise DataError(f"{spec.key_path}.images: the checkpoint has no processor for its "
                            "images; a vision-language model's folder holds one")
        for key in self.reads:
            _no_nulls(table, getattr(spec, key), f"{spec.key_path}.{key}", spec)
        self.check_table(table, spec)
        done = prepared.array_rows(table, proc.key)       # processed on a Ray Data stage
        x = self.from_arrays(table, spec, proc, *done) if done is not None else \
            self.tokenize(table, spec, proc, decoder)
        if getattr(decoder, "samples", False):
            x.items = self.item_fields(table, spec)
            x.items["thumbnails"] = x.thumbnails if x.thumbnails is not None else \
                samples.thumbnails(x.images)                   # 0.3 ms a 64 px image
            x.nbytes += sum(len(str(v)) for column in x.items.values() for v in column)
        return x, self.targets(table, spec)

    def tokenize(self, table, spec, tok, decoder):
        if spec.images is None:
            return super().tokenize(table, spec, tok, decoder)
        root = image_io.root_for(spec.path)
        questions = data.column_array(table, spec.prompt).to_pylist()
        cells = data.column_array(table, spec.images).to_pylist()
        prompts, pictures, inputs = [], [], []
        for i, (question, cell) in enumerate(zip(questions, cells)):
            decoded = image_io.decode_cell(cell, root, _row(table, spec, i),
                                           f"{spec.key_path}.images")
            prompt = tok.render(question, len(decoded))
            prompts.append(prompt)
            pictures.append(decoded)
            inputs.append(tok.inputs(prompt, decoded))
        return self.image_batch(table, spec, tok, prompts, pictures, inputs)

    def image_batch(self, table, spec, tok, prompts, pictures, inputs) -> ImageBatch:
        """The rows of ``table`` tokenized: each row's prompt, decoded images and processor
        outputs, with the task's ``item_extra`` and the bytes they hold."""
        extra = self.item_extra(table, spec, tok, prompts)
        n = sum(int(t.nbytes) for row in inputs for t in row.values()) + sum(
            int(a.nbytes) for row in pictures for a in row)
        return ImageBatch(prompts, pictures, inputs, extra, n,
                          ids=self.row_ids(table, spec, None, None).tolist())

    def prepared_table(self, table, x, key: str, pixels: bool = True, records: bool = False):
        """A stage's output: the table with what ``tokenize`` made of it; without ``pixels``
        an image item's decoded images stay behind (thumbnails go instead, for ``records``)."""
        if not isinstance(x, ImageBatch):
            return super().prepared_table(table, x, key)
        if not pixels:
            x = self.without_pixels(x, records)
        rows = [{"image": list(ims), **{f"input.{k}": [v] for k, v in inp.items()}}
                for ims, inp in zip(x.images, x.inputs)]
        if x.thumbnails is not None:          # PNG bytes, as uint8 arrays
            for row, thumbs in zip(rows, x.thumbnails):
                row["thumbnail"] = [np.frombuffer(t, np.uint8) for t in thumbs]
        return prepared.attach_arrays(table, rows, {PROMPT: x.prompts}, key)

    def without_pixels(self, x, records: bool):
        """A stage's batch without the decoded images (the worker scores from the
        processor's outputs), with their thumbnails when per-item records are kept."""
        thumbs = samples.thumbnails(x.images) if records else None
        return dataclasses.replace(x, images=[() for _ in x.images], thumbnails=thumbs)

    def from_arrays(self, table, spec, proc, rows, texts) -> ImageBatch:
        prompts = texts[PROMPT]
        pictures = [row["image"] for row in rows]
        thumbs = [[a.tobytes() for a in row["thumbnail"]] for row in rows] \
            if rows and "thumbnail" in rows[0] else None
        inputs = [{k[len("input."):]: torch.from_numpy(v[0]) for k, v in row.items()
                   if k.startswith("input.")} for row in rows]
        extra = self.item_extra(table, spec, proc, prompts)
        n = sum(int(t.nbytes) for row in inputs for t in row.values()) + sum(
            int(a.nbytes) for row in pictures for a in row)
        return ImageBatch(prompts, pictures, inputs, extra, n,
                          ids=self.row_ids(table, spec, None, None).tolist(), thumbnails=thumbs)

    def row_ids(self, table, spec, x, y):
        if spec.images is None or spec.id is not None:
            return super().row_ids(table, spec, x, y)
        columns = [getattr(spec, k) for k in self.reads] + [spec.images] + (
            [spec.target] if spec.target else [])
        values = [data.column_array(table, c).to_pylist() for c in columns]
        return torch.tensor([_content_id(row) for row in zip(*values)], dtype=torch.int64)

    def item_fields(self, table, spec):
        fields = super().item_fields(table, spec)
        if spec.images is not None:
            cells = data.column_array(table, spec.images).to_pylist()
            fields["images"] = [[s if isinstance(s, str) else f"<{len(s)} bytes>"
                                 for s in image_io.sources_of(c)] for c in cells]
        return fields

    def join(self, xs):
        if xs and isinstance(xs[0], ImageBatch):
            return join(xs)
        return super().join(xs)

    def first_tokens(self, x):
        if isinstance(x, ImageBatch):
            return [int(t) for t in x.inputs[0]["input_ids"].reshape(-1).tolist()]
        return super().first_tokens(x)

    def probe_input(self, x):
        if isinstance(x, ImageBatch):
            return torch.tensor([self.first_tokens(x)], dtype=torch.int64)
        return super().probe_input(x)

    def item_extra(self, table, spec, proc, prompts) -> list:
        raise NotImplementedError


class ImageGeneration(ImageItems, Generation):
    """``generation``, with images when ``dataset.images`` is set."""

    def item_extra(self, table, spec, proc, prompts):
        return data.column_array(table, spec.target).to_pylist()

    def score(self, backend, x, y, ctx):
        if not isinstance(x, ImageBatch):
            return super().score(backend, x, y, ctx)
        texts = backend.generate_images(x.requests(), x.ids, ctx)
        x.responses = [t[0] for t in texts]
        x.repeats = texts if ctx.generation.repeats > 1 else None
        return self.score_texts(texts, x), y

    def score_texts(self, texts: list[list[str]], x: ImageBatch) -> torch.Tensor:
        """Each item's float row from its generated texts: exact match with the answer (both
        stripped), the mean over its repeats. lmms-eval's task overrides this."""
        hit = [sum(float(g.strip() == str(a).strip()) for g in t) / len(t)
               for t, a in zip(texts, x.extra)]
        return torch.tensor(hit, dtype=torch.float64)

class ImageMultipleChoice(ImageItems, MultipleChoice):
    """``multiple_choice``, with images when ``dataset.images`` is set: each choice is scored
    by its log-likelihood after the rendered prompt and the images, the delimiter before it
    (lm-eval's split: prompt and choice encoded together, cut at the prompt's tokens)."""

    def item_extra(self, table, spec, proc, prompts):
        choices = data.column_array(table, spec.choices).to_pylist()
        out = []
        for i, (prompt, options) in enumerate(zip(prompts, choices)):
            conts = [proc.encode_pair(prompt, spec.delimiter + c)[1] for c in options]
            if any(not c for c in conts):
                raise DataError(f"{spec.key_path}.choices: {_row(table, spec, i)} has a choice "
                                "that encodes to no tokens; give it some text")
            out.append((conts, [float(len(c)) for c in options]))
        return out

    def score(self, backend, x, y, ctx):
        if not isinstance(x, ImageBatch):
            return super().score(backend, x, y, ctx)
        requests = [(r, conts) for r, (conts, _) in zip(x.requests(), x.extra)]
        lls = backend.loglikelihood_images(requests, ctx)
        width = max(len(conts) for conts, _ in x.extra)
        out = torch.zeros((len(x.extra), width, 2), dtype=torch.float64)
        out[:, :, 0] = float("-inf")
        out[:, :, 1] = 1.0
        for i, (item, (conts, chars)) in enumerate(zip(lls, x.extra)):
            out[i, :len(conts), 0] = torch.tensor([ll for ll, _ in item], dtype=torch.float64)
            out[i, :len(conts), 1] = torch.tensor(chars, dtype=torch.float64)
        return out, y

    def item_records(self, x, out):
        if not isinstance(x, ImageBatch):
            return super().item_records(x, out)
        records = dict(x.items)
        lls = [[float(v) for v in row[:len(conts), 0].tolist()]
               for row, (conts, _) in zip(out, x.extra)]
        best = [max(range(len(v)), key=lambda j, v=v: (v[j], -j)) for v in lls]
        records["response"] = [opts[b] for opts, b in zip(x.items["choices"], best)]
        records["loglikelihoods"] = lls
        return records

