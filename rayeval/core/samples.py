"""Per-item records: what a checkpoint did with each item of a text (or image and text) task
or a classification.

A worker's pass keeps, for each item it scored, the item's id, the context the model saw, the
choices (multiple choice), the target, the response (the choice with the highest
log-likelihood, the generated text, or the predicted class; all of them as ``responses`` when
sampled repeatedly), the log-likelihoods (each choice's, or the document's), a classification's
``probability`` of the class it predicted, the item's images (where each came from, and each
as a small PNG thumbnail: ``thumbnail``), and the item's value of each metric that has one
(``evaluate.item_values``). Each worker writes its own items
(``reporting.store.ResultStore.write_samples``); nothing is gathered.

Why a thumbnail in the record and not a reference to the source row: the record then shows the
item wherever the store goes (the data set may be private, moved, on another bucket, or read
through a Ray Data stage that has no row address), and the page a person reads
(``rayeval samples --format html``) needs no access to the data. The cost is small: a 64 px
PNG of an easy-vqa image is 426 bytes on average (200 test images; the files are 424) and takes
0.3 ms to make; of a 640x480 image of pure noise (the worst case for PNG) 5.3 KB.
"""

from __future__ import annotations

import pyarrow as pa

from rayeval.io import images as image_io

# The columns every record has, in order, and their types; metric values follow (float64).
# ``id`` keeps the id column's own type (a content id is int64).
COLUMNS = {
    "row": pa.int64(),                       # the item's position in its data set (io.data.ROW)
    "context": pa.string(),
    "images": pa.list_(pa.string()),         # image items: each image's path, or its size
    "choices": pa.list_(pa.string()),
    "target": pa.string(),
    "response": pa.string(),
    "responses": pa.list_(pa.string()),      # every generation, with generation.repeats > 1
    "loglikelihoods": pa.list_(pa.float64()),
    "tokens": pa.int64(),
    "probability": pa.float64(),             # classification: the predicted class's softmax
    "thumbnails": pa.list_(pa.binary()),     # the item's images as PNGs (``thumbnail``)
    "values": pa.string(),    # a task's own-aggregation values, JSON (``harness.items``)
}

THUMBNAIL_PX = 64      # the longest side of a record's image: enough to see what was asked


def thumbnail(image, px: int = THUMBNAIL_PX) -> bytes:
    """An image (a PIL image, or a numpy uint8 array HxW or HxWx3/4) as PNG bytes whose
    longest side is at most ``px`` (a smaller image is kept as it is)."""
    import io

    from PIL import Image

    if not isinstance(image, Image.Image):
        image = Image.fromarray(image)
    if image.mode not in ("RGB", "RGBA", "L"):
        image = image.convert("RGB")
    if max(image.size) > px:
        image = image.copy()
        image.thumbnail((px, px), Image.Resampling.BICUBIC, reducing_gap=2.0)
    out = io.BytesIO()
    image.save(out, format="PNG")   # optimize=True: 10% smaller, 4x slower (1.3 vs 0.3 ms)
    return out.getvalue()


def thumbnails(images: list) -> list[list[bytes]]:
    """Each item's images (a list per item) as thumbnails: the ``thumbnails`` column."""
    return [[thumbnail(a) for a in item] for item in images]


def image_thumbnails(table, spec) -> list[list[bytes]] | None:
    """Each row's images as thumbnails, for a tensor task's records (image classification):
    the images of the input columns that hold encoded images (``image_columns``); None when
    none does, or PIL (the ``vlm`` extra) is missing: a transform may decode without it."""
    columns = image_columns(table.schema, spec.inputs)
    if not columns:
        return None
    try:
        import PIL  # noqa: F401
    except ImportError:
        return None
    root = image_io.root_for(spec.path)
    cells = [table.column(c).to_pylist() for c in columns]
    return [[t for cell in row for t in _thumbnails_of(cell, root)] for row in zip(*cells)]


def image_columns(schema: pa.Schema, inputs) -> list[str]:
    """The columns among ``inputs`` (all of them when none is named: a transform that reads
    what it likes) that hold encoded images: bytes, Hugging Face ``{bytes, path}`` structs, or
    lists of those. Strings are not taken for paths (text is as likely); fixed-size binary is
    a tensor's bytes more likely than an image's."""
    names = [c for c in inputs if c in schema.names] if inputs else schema.names
    return [c for c in names if _holds_images(schema.field(c).type)]


def _holds_images(typ: pa.DataType) -> bool:
    if pa.types.is_list(typ) or pa.types.is_large_list(typ):
        typ = typ.value_type
    if pa.types.is_struct(typ):
        return typ.get_field_index("bytes") >= 0
    return pa.types.is_binary(typ) or pa.types.is_large_binary(typ)


def _thumbnails_of(cell, root: str) -> list[bytes]:
    """One cell's images as thumbnails; a value that is no readable image gets none: the
    record's picture never fails an evaluation the model itself could score."""
    out = []
    try:
        found = image_io.sources_of(cell)
    except Exception:                  # noqa: BLE001 - not an image value at all
        return out
    for source in found:
        try:
            out.append(encoded_thumbnail(image_io.read_bytes(source, root)))
        except Exception:              # noqa: BLE001 - PIL raises many types for bad files
            continue
    return out


def encoded_thumbnail(data: bytes) -> bytes:
    """The thumbnail of encoded image bytes (PNG, JPEG, ...), its mode kept where a PNG can
    hold it (a grey image stays grey: a third of the RGB bytes)."""
    import io

    from PIL import Image

    with Image.open(io.BytesIO(data)) as image:
        image.load()
        return thumbnail(image)


def records_table(batches: list[dict[str, list]]) -> pa.Table:
    """One table from the records of a pass's scored batches (column lists per batch)."""
    names = list(dict.fromkeys(k for b in batches for k in b))
    columns = {k: [v for b in batches for v in b.get(k, [None] * _rows(b))] for k in names}
    arrays, fields = [], []
    if "id" in columns:
        arrays.append(pa.array(columns.pop("id")))
        fields.append(pa.field("id", arrays[-1].type))
    for name, typ in COLUMNS.items():
        if name in columns:
            values = columns.pop(name)
            if all(v is None for v in values):   # not the task's (a document's target)
                continue
            if name == "target":
                values = [None if v is None else str(v) for v in values]
            arrays.append(pa.array(values, typ))
            fields.append(pa.field(name, typ))
    for name, values in columns.items():          # the metrics', in the sweep's order
        arrays.append(pa.array(values, pa.float64()))
        fields.append(pa.field(name, pa.float64()))
    return pa.Table.from_arrays(arrays, schema=pa.schema(fields))


def _rows(batch: dict[str, list]) -> int:
    return len(next(iter(batch.values()))) if batch else 0
