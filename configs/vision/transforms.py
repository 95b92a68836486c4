"""The vision example's ``dataset.transform`` functions. rayeval calls one with each batch as a
pyarrow Table (the ``inputs`` columns, the target and the id) and feeds what it returns to the
model: a tensor as the one positional argument, a dict as keyword arguments.

PIL decodes the PNG bytes here, in the example's own module: rayeval itself does not need it.
"""

import io

import numpy as np
import torch
from PIL import Image


def decode(table) -> torch.Tensor:
    """The ``image`` column's PNG bytes as float32 (rows, 3, H, W) in [0, 1]."""
    images = [np.asarray(Image.open(io.BytesIO(png)).convert("RGB"))
              for png in table.column("image").to_pylist()]
    if not images:
        return torch.zeros((0, 3, 16, 16))
    x = np.stack(images).astype(np.float32) / 255.0            # (rows, H, W, 3)
    return torch.from_numpy(x).permute(0, 3, 1, 2).contiguous()


def decode_with_brightness(table) -> dict:
    """Keyword inputs for ``model(image=..., brightness=...)``: the decoded images and each
    image's exposure from the ``brightness`` column."""
    brightness = table.column("brightness").to_numpy().astype(np.float32)
    return {"image": decode(table), "brightness": torch.from_numpy(brightness)}
