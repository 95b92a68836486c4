"""Image columns of image+text items (``dataset.images``): each row holds one image or a list
of images, as encoded bytes (PNG, JPEG, ... as PIL reads them), a Hugging Face ``Image``
struct ``{bytes, path}`` (a ``save_to_disk`` folder's ``Image`` feature), or a path string,
absolute, a URI, or relative to the data set's folder (a questions file beside a folder of
images).

Decoding gives RGB numpy arrays (uint8, height x width x 3), fully loaded so that a truncated
file fails here, named by its row, and never later inside a model. PIL is imported only when
an image is decoded (the ``vlm`` extra brings it).
"""

from __future__ import annotations

import contextlib
import io
import os

import numpy as np
import pyarrow as pa

from rayeval.errors import DataError
from rayeval.io import paths


def column_type_ok(typ: pa.DataType) -> bool:
    """Whether a column can hold images: binary, string, an {bytes, path} struct, or a list
    of those."""
    if pa.types.is_list(typ) or pa.types.is_large_list(typ):
        typ = typ.value_type
    if pa.types.is_struct(typ):
        names = {typ.field(i).name for i in range(typ.num_fields)}
        return bool(names & {"bytes", "path"})
    return (pa.types.is_binary(typ) or pa.types.is_large_binary(typ)
            or pa.types.is_fixed_size_binary(typ) or pa.types.is_string(typ)
            or pa.types.is_large_string(typ))


def sources_of(value) -> list:
    """One cell's images as a list of bytes or path strings (empty: the item has none)."""
    if value is None:
        return []
    if isinstance(value, (list, tuple)):
        return [s for v in value for s in sources_of(v)]
    if isinstance(value, dict):
        data, path = value.get("bytes"), value.get("path")
        if data:
            return [bytes(data)]
        return [path] if path else []
    if isinstance(value, (bytes, bytearray, memoryview)):
        return [bytes(value)] if len(value) else []
    if isinstance(value, str):
        return [value] if value else []
    raise DataError(f"an image value of type {type(value).__name__}; give bytes, a path or "
                    "an {bytes, path} struct")


def read_bytes(source, root: str | None) -> bytes:
    """The encoded bytes of one image source (bytes as they are, a path read)."""
    if isinstance(source, bytes):
        return source
    location = source if (paths.is_uri(source) or os.path.isabs(source) or not root) else (
        f"{root.rstrip('/')}/{source}" if paths.is_uri(root) else os.path.join(root, source))
    fs, path = paths.filesystem(location)
    with fs.open_input_file(path) as f:
        return f.read()


@contextlib.contextmanager
def _truncation_refused():
    """PIL's process-wide ``ImageFile.LOAD_TRUNCATED_IMAGES`` off while rayeval decodes:
    importing lmms-eval's task module turns it on (``lmms_eval/api/task.py``, 0.7.3), and a
    worker that scores an lmms-eval task would then decode a truncated file silently, its
    missing rows grey. Put back afterwards, for lmms-eval's own ``doc_to_visual``."""
    from PIL import ImageFile

    before = ImageFile.LOAD_TRUNCATED_IMAGES
    ImageFile.LOAD_TRUNCATED_IMAGES = False
    try:
        yield
    finally:
        ImageFile.LOAD_TRUNCATED_IMAGES = before


def decode_bytes(data: bytes) -> np.ndarray:
    """RGB uint8 (height, width, 3) of encoded image bytes, fully decoded."""
    from PIL import Image

    with _truncation_refused(), Image.open(io.BytesIO(data)) as im:
        im.load()                      # decodes every pixel: a truncated file raises here
        return np.asarray(im.convert("RGB"), dtype=np.uint8).copy()


def verify_bytes(data: bytes) -> None:
    """A cheap integrity check without decoding pixels: PNG chunk CRCs, JPEG markers and
    truncation, as PIL's ``verify`` finds them."""
    from PIL import Image

    with _truncation_refused(), Image.open(io.BytesIO(data)) as im:
        im.verify()


def decode_cell(value, root: str | None, row: str, key: str, check_only: bool = False
                ) -> list[np.ndarray]:
    """A row's images, decoded (``check_only``: read and verified, nothing returned); a
    one-line DataError naming the row when it has none or one cannot be read or decoded."""
    found = sources_of(value)
    if not found:
        raise DataError(f"{key}: {row} has no image; every item of this task needs one "
                        "(fill the column or drop the row)")
    out = []
    for k, source in enumerate(found):
        what = source if isinstance(source, str) else f"image {k} ({len(source)} bytes)"
        try:
            data = read_bytes(source, root)
        except (OSError, ValueError) as e:
            raise DataError(f"{key}: {row}: cannot read {what}: "
                            f"{paths.explain(e, str(source))}") from None
        try:
            if check_only:
                verify_bytes(data)
            else:
                out.append(decode_bytes(data))
        except Exception as e:          # noqa: BLE001 - PIL raises many types for bad files
            raise DataError(f"{key}: {row}: {what} is not a readable image "
                            f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})"
                            "; re-encode or drop it") from None
    return out


def root_for(location: str) -> str:
    """The folder that relative image paths of a data set at ``location`` are taken from: the
    folder itself, a file's folder, or a glob's folder before its first wildcard."""
    if paths.has_glob(location):
        head = location[:min(location.find(c) for c in "*?[" if c in location)]
        return head.rsplit("/", 1)[0] if "/" in head else "."
    try:
        if paths.is_dir(location):
            return location.rstrip("/")
    except OSError:
        pass
    return location.rsplit("/", 1)[0] if paths.is_uri(location) else os.path.dirname(location)
