"""What the plugin adds to checkpoints: the layout ``example-npz``, a numpy ``.npz`` archive of
named arrays (``np.savez``), read with ``allow_pickle=False`` so that no object array (a pickle)
in the file is ever loaded."""

import zipfile

import numpy as np
import torch

from rayeval.io import layouts


@layouts.DETECTORS.register("example-npz")
def detect(path: str):
    """An ``.npz`` file: a zip archive whose members are ``.npy`` arrays."""
    if not path.endswith(".npz") or not zipfile.is_zipfile(path):
        return None
    with zipfile.ZipFile(path) as z:
        return "example-npz" if all(n.endswith(".npy") for n in z.namelist()) else None


@layouts.READERS.register("example-npz")
def read(src: layouts.Source):
    with np.load(src.target, allow_pickle=False) as archive:
        tensors = {name: torch.from_numpy(np.array(archive[name])) for name in archive.files}
    return layouts.from_tensors("example-npz", src.path, tensors, files=(src.target,))
