"""Checkpoint layouts: what a checkpoint file or folder holds, detected from its own bytes and
files (not only its name), read safely into flat tensors.

    torch         a torch.save file (zip or legacy): any dict of tensors, nested under any keys
    lightning     a PyTorch Lightning .ckpt (a torch.save dict with state_dict and global_step)
    safetensors   one safetensors file
    safetensors-sharded / torch-sharded
                  Hugging Face shards listed by model.safetensors.index.json /
                  pytorch_model.bin.index.json
    dcp           a torch.distributed.checkpoint folder (.metadata + __R_I.distcp), any ranks
    (folders)     a Ray Train checkpoint folder, or any folder holding one of the above
    deepspeed     a DeepSpeed ZeRO folder: refused, with the conversion to run

Pickles are read with ``torch.load(weights_only=True)``; DCP's .metadata pickle with an
allow-list. ``trust_pickle`` (the sweep's ``checkpoint.trust_pickle``) lets a torch.save file that
needs more be loaded in full, with a warning per file.

This module finds the layout and holds the readers' registry (``DETECTORS``, ``READERS``:
where a plugin adds a layout, docs/plugins.md); each family's reading is in its own module of
this package: ``torch_files``, ``safetensors_files``, ``dcp_folders``, and ``raw``: what they
all return (``Raw``, ``from_tensors``) and the corrupt-file error they share.
"""

from __future__ import annotations

import os
import struct
from dataclasses import dataclass
from typing import Callable, Mapping

from rayeval.config.registry import Registry
from rayeval.errors import CheckpointError
# Each family of layouts in its own module; their public names are re-exported here, where the
# loader, the sharding and the worker find them (``layouts.read_dcp_tensors``, ...).
# corrupt: the one-line error for a damaged file, for a plugin's reader as for these
from rayeval.io.layouts.raw import Raw, corrupt, from_tensors, weight_map  # noqa: F401
from rayeval.io.layouts.safetensors_files import (_SafetensorsRows, _open_safetensors,
                                                  _safetensors)
from rayeval.io.layouts.torch_files import _NOT_MAPPED, flatten, release, torch_load
from rayeval.lazy import lazy_module

torch = lazy_module("torch")        # imported on first use (rayeval.lazy)

CHECKPOINT_SUFFIXES = (".pt", ".pth", ".bin", ".ckpt", ".safetensors")
HF_INDEXES = {"model.safetensors.index.json": "safetensors-sharded",
              "pytorch_model.bin.index.json": "torch-sharded"}
HF_SINGLE = ("model.safetensors", "pytorch_model.bin")


# --- finding the layout ----------------------------------------------------------------------

def sniff_file(path: str) -> str:
    """``"torch"`` or ``"safetensors"`` from a file's first bytes."""
    try:
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            head = f.read(9)
    except OSError as e:
        raise CheckpointError(f"{path}: cannot read the checkpoint: {e.strerror}") from None
    if size == 0:
        raise CheckpointError(f"{path}: empty file, not a checkpoint (truncated write?)")
    if head[:4] == b"PK\x03\x04":
        return "torch"
    if len(head) >= 2 and head[0] == 0x80 and 2 <= head[1] <= 5:
        return "torch"                      # legacy (non-zip) torch.save pickle
    if len(head) == 9 and head[8:9] == b"{":
        (header_len,) = struct.unpack("<Q", head[:8])
        if 8 + header_len <= size:
            return "safetensors"
        raise CheckpointError(f"{path}: truncated safetensors file (header says "
                              f"{header_len} bytes, file has {size})")
    if path.endswith(".index.json"):
        return "index"
    raise CheckpointError(f"{path}: not a checkpoint: expected a torch.save file, a "
                          "safetensors file or a torch.distributed.checkpoint folder")


# A plugin's layout (``docs/plugins.md``): a detector that recognises its own files, asked before
# the built-in detection, returning the layout name its reader is registered under in
# ``READERS`` (or ``(layout, path to read)`` for a folder), or None for files it does not know.
DETECTORS: Registry[Callable[[str], "str | tuple[str, str] | None"]] = Registry(
    "checkpoint layout detector")


def _plugin_layout(path: str) -> tuple[str, str] | None:
    for _, detect in DETECTORS.items():
        found = detect(path)
        if found is not None:
            return found if isinstance(found, tuple) else (found, path)
    return None


def detect_format(path: str) -> str:
    """The layout at a local path (see the module docstring)."""
    found = _plugin_layout(path)
    if found is not None:
        return found[0]
    if not os.path.isdir(path):
        kind = sniff_file(path)
        if kind == "index":
            name = os.path.basename(path)
            return HF_INDEXES.get(name, "safetensors-sharded" if "safetensors" in name
                                  else "torch-sharded")
        return kind
    return detect_folder(path)[0]


def detect_folder(path: str) -> tuple[str, str]:
    """(layout, the path inside the folder to read)."""
    found = _plugin_layout(path)
    if found is not None:
        return found
    names = set(os.listdir(path))
    if ".metadata" in names:
        return "dcp", path
    _refuse_deepspeed(path, names)
    for index, layout in HF_INDEXES.items():
        if index in names:
            return layout, os.path.join(path, index)
    for single in HF_SINGLE:
        if single in names:
            return sniff_file(os.path.join(path, single)), os.path.join(path, single)
    # A Ray Train checkpoint folder, or any folder: exactly one checkpoint inside it.
    inside = sorted(n for n in names if not n.startswith((".", "_")) and (
        n.endswith(CHECKPOINT_SUFFIXES) or
        (os.path.isdir(os.path.join(path, n)) and
         os.path.exists(os.path.join(path, n, ".metadata")))))
    if len(inside) == 1:
        target = os.path.join(path, inside[0])
        return detect_format(target), target
    if not inside:
        raise CheckpointError(f"{path}: a folder without .metadata and without a checkpoint "
                              "file inside is not a checkpoint; point the glob at checkpoint "
                              "files or folders")
    raise CheckpointError(f"{path}: the folder holds several checkpoints ({', '.join(inside)});"
                          " point the glob at one of them")


def _refuse_deepspeed(path: str, names: set[str]) -> None:
    step_dirs = [n for n in names if os.path.isdir(os.path.join(path, n))
                 and any(f.endswith(("model_states.pt", "optim_states.pt"))
                         for f in os.listdir(os.path.join(path, n)))]
    own = any(n.endswith(("model_states.pt", "optim_states.pt")) for n in names)
    if step_dirs or own or "zero_to_fp32.py" in names:
        raise CheckpointError(
            f"{path}: a DeepSpeed ZeRO checkpoint (sharded optimizer and model states) cannot "
            "be read directly; convert it to one state dict with DeepSpeed's "
            "`python zero_to_fp32.py CHECKPOINT_DIR OUTPUT_DIR` (saved in the checkpoint "
            "folder) or deepspeed.utils.zero_to_fp32.convert_zero_checkpoint_to_fp32_state_dict"
            ", then point the sweep at the result")


# --- reading ---------------------------------------------------------------------------------

def read(path: str, trust_pickle: bool = False, lazy: bool = False) -> Raw:
    """Everything a checkpoint at a local path holds, as flat tensors (DCP: shapes only).

    ``lazy``: safetensors files are opened, not read: their tensors' rows are read on demand
    (``read_rows``), so a rank of a sharded model reads only its own slices."""
    layout = detect_format(path)
    target = detect_folder(path)[1] if os.path.isdir(path) else path
    return READERS.get(layout)(Source(layout, target, path, trust_pickle, lazy))


@dataclass(frozen=True)
class Source:
    """What a layout's reader is handed: the detected layout, the file or folder to read
    (``target``: inside a checkpoint folder, the index or file found there), the path the sweep
    named, and the sweep's checkpoint options."""
    layout: str
    target: str
    path: str
    trust_pickle: bool = False
    lazy: bool = False


# Layout name (as ``detect_format`` names it) -> its reader. Adding a layout is teaching
# ``detect_format`` its files (a built-in) or registering a detector in DETECTORS (a plugin),
# and registering a reader here.
READERS: Registry[Callable[[Source], Raw]] = Registry("checkpoint layout")


# torch.distributed.checkpoint is imported when a DCP folder is met: it pulls in DTensor's
# operator tables, 0.6 s of every worker's and driver's start (of 3.2 s) on the 2-core machine.
@READERS.register("dcp")
def _read_dcp(src: Source) -> Raw:
    from rayeval.io.layouts.dcp_folders import _read_dcp_metadata

    return _read_dcp_metadata(src.target)


def read_dcp_tensors(raw: Raw, keys: list[str]) -> dict[str, torch.Tensor]:
    from rayeval.io.layouts import dcp_folders

    return dcp_folders.read_dcp_tensors(raw, keys)


def dcp_failure(e: BaseException) -> str:
    from rayeval.io.layouts import dcp_folders

    return dcp_folders.dcp_failure(e)


@READERS.register("safetensors")
@READERS.register("safetensors-sharded")
def _read_safetensors(src: Source) -> Raw:
    if src.lazy:
        return _open_safetensors(src.target, src.layout, src.path)
    if src.layout == "safetensors-sharded":
        return _read_sharded(src.target, src.layout, src.trust_pickle)
    return from_tensors("safetensors", src.path, _safetensors(src.target), files=(src.target,))


@READERS.register("torch-sharded")
def _read_torch_sharded(src: Source) -> Raw:
    return _read_sharded(src.target, src.layout, src.trust_pickle)


@READERS.register("torch")
def _read_torch(src: Source) -> Raw:
    """A torch.save file; a Lightning checkpoint is one with its step and version keys."""
    obj = torch_load(src.target, src.trust_pickle)
    layout, step = "torch", None
    if isinstance(obj, Mapping):
        gs = obj.get("global_step")
        if isinstance(gs, int) and not isinstance(gs, bool):
            step = gs
        if "pytorch-lightning_version" in obj or "lightning_version" in obj or \
                ("state_dict" in obj and "global_step" in obj):
            layout = "lightning"
    raw = from_tensors(layout, src.path, flatten(obj, src.target), files=(src.target,))
    raw.step = step
    raw.mapped = src.target not in _NOT_MAPPED
    return raw


def _read_sharded(index: str, layout: str, trust_pickle: bool) -> Raw:
    weights = weight_map(index)
    folder = os.path.dirname(index)
    tensors: dict[str, torch.Tensor] = {}
    shards = sorted(set(weights.values()))
    for shard in shards:
        path = os.path.join(folder, shard)
        if not os.path.exists(path):
            raise CheckpointError(f"{index}: shard {shard} is missing")
        part = _safetensors(path) if sniff_file(path) == "safetensors" else \
            flatten(torch_load(path, trust_pickle), path)
        tensors.update(part)
    missing = sorted(set(weights) - set(tensors))
    if missing:
        raise CheckpointError(f"{index}: tensors listed in the index are in no shard: "
                              f"{', '.join(missing[:5])}")
    return from_tensors(layout, os.path.dirname(index), tensors,
                        files=(index,) + tuple(os.path.join(folder, s) for s in shards))


def read_rows(raw: Raw, key: str, start: int, stop: int, out: torch.Tensor | None = None
              ) -> torch.Tensor:
    """Rows ``start:stop`` (the first dimension) of one tensor of a checkpoint read with
    ``read``: memory-mapped files and lazy safetensors read only those rows (lazy safetensors
    straight into ``out`` when it fits: no copy)."""
    if raw.tensors is not None:
        t = raw.tensors[key]
        return t if t.dim() == 0 else t[start:stop]
    if isinstance(raw.reader, _SafetensorsRows):
        return raw.reader.rows(key, start, stop, out)
    raise TypeError(f"{raw.layout}: rows are read with dcp.load; please report this bug")
