"""Safetensors files: read whole, or opened lazily (one file or a Hugging Face index's shards)
so that a tensor's rows are read on demand."""

from __future__ import annotations

import functools
import json
import math
import os
import struct

from rayeval import errors
from rayeval.errors import CheckpointError
from rayeval.io.layouts.raw import Raw, weight_map
from rayeval.lazy import lazy_module

torch = lazy_module("torch")        # imported on first use (rayeval.lazy)


def _safetensors(path: str) -> dict[str, torch.Tensor]:
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    try:
        return load_file(path, device="cpu")
    except (SafetensorError, OSError, ValueError) as e:
        raise errors.wrap(e, CheckpointError, f"{path}: corrupt safetensors file",
                          location=path) from None


class _SafetensorsRows:
    """Safetensors files read a tensor's rows at a time, with plain reads (no memory map, so no
    file pages stay resident): a row-major tensor's rows are one contiguous byte range."""

    def __init__(self, entries: dict[str, tuple[str, int, torch.dtype, tuple[int, ...]]]):
        self.entries = entries                   # key -> (file, data offset, dtype, shape)

    def rows(self, key: str, start: int, stop: int, out: torch.Tensor | None = None
             ) -> torch.Tensor:
        """Rows ``start:stop`` (the whole tensor when it is 0-d), read into ``out`` when it
        is a contiguous tensor of the right dtype and shape, else into a new tensor."""
        path, offset, dtype, shape = self.entries[key]
        if not shape:
            start, stop = 0, 1
        want = (stop - start, *shape[1:]) if shape else ()
        if out is None or out.dtype != dtype or tuple(out.shape) != want or \
                not out.is_contiguous() or out.device.type != "cpu":
            out = torch.empty(want, dtype=dtype)
        row = torch.empty((), dtype=dtype).element_size() * math.prod(shape[1:])
        view = memoryview(out.reshape(-1).view(torch.uint8).numpy()) if out.numel() else None
        if view is not None:
            with open(path, "rb") as f:
                f.seek(offset + start * row)
                if f.readinto(view) != len(view):
                    raise CheckpointError(f"{path}: truncated safetensors file ({key})")
        return out


@functools.cache
def _st_dtypes() -> dict[str, torch.dtype]:
    return {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16,
            "BF16": torch.bfloat16, "I64": torch.int64, "I32": torch.int32,
            "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8, "BOOL": torch.bool}


def _safetensors_header(path: str) -> dict[str, tuple[str, int, torch.dtype, tuple[int, ...]]]:
    """Each tensor of a safetensors file: (file, byte offset of its data, dtype, shape)."""
    try:
        with open(path, "rb") as f:
            (length,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(length))
    except (OSError, ValueError, struct.error) as e:
        raise errors.wrap(e, CheckpointError, f"{path}: corrupt safetensors file",
                          location=path) from None
    out = {}
    for key, entry in header.items():
        if key == "__metadata__":
            continue
        if entry.get("dtype") not in _st_dtypes():
            raise CheckpointError(f"{path}: tensor {key} has dtype {entry.get('dtype')!r}, "
                                  "which rayeval cannot read sliced")
        out[key] = (path, 8 + length + int(entry["data_offsets"][0]), _st_dtypes()[entry["dtype"]],
                    tuple(entry["shape"]))
    return out


def _open_safetensors(target: str, layout: str, path: str) -> Raw:
    if layout == "safetensors":
        files = [target]
    else:
        folder = os.path.dirname(target)
        files = [os.path.join(folder, s) for s in sorted(set(weight_map(target).values()))]
        for f in files:
            if not os.path.exists(f):
                raise CheckpointError(f"{target}: shard {os.path.basename(f)} is missing")
    entries = {}
    for f in files:
        entries.update(_safetensors_header(f))
    shapes = {k: (shape, dtype) for k, (_, _, dtype, shape) in entries.items()}
    return Raw(layout=layout, path=path if layout == "safetensors" else os.path.dirname(target),
               shapes=shapes, files=tuple([target] if layout != "safetensors" else []) +
               tuple(files), reader=_SafetensorsRows(entries))
