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
"""

from __future__ import annotations

import json
import logging
import math
import os
import pickle
import re
import struct
import sys
import warnings
import zipfile
from dataclasses import dataclass, field
from typing import Callable, Mapping

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import StorageMeta, TensorStorageMetadata

from rayeval.config.registry import Registry
from rayeval import errors
from rayeval.errors import CheckpointError

log = logging.getLogger("rayeval")

CHECKPOINT_SUFFIXES = (".pt", ".pth", ".bin", ".ckpt", ".safetensors")
HF_INDEXES = {"model.safetensors.index.json": "safetensors-sharded",
              "pytorch_model.bin.index.json": "torch-sharded"}
HF_SINGLE = ("model.safetensors", "pytorch_model.bin")


@dataclass
class Raw:
    """A checkpoint's tensors, flattened to dotted keys (``model.fc.weight``)."""
    layout: str
    path: str                                         # the file or folder read
    shapes: dict[str, tuple[tuple[int, ...], torch.dtype]]
    tensors: dict[str, torch.Tensor] | None = None    # None for DCP: read on demand
    step: int | None = None                           # from the file (Lightning global_step)
    files: tuple[str, ...] = ()
    reader: object | None = field(default=None, repr=False)
    mapped: bool = False                              # tensors are torch.load's memory map


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


def detect_format(path: str) -> str:
    """The layout at a local path (see the module docstring)."""
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
# ``detect_format`` its files and registering a reader here.
READERS: Registry[Callable[[Source], Raw]] = Registry("checkpoint layout")


@READERS.register("dcp")
def _read_dcp(src: Source) -> Raw:
    return _read_dcp_metadata(src.target)


@READERS.register("safetensors")
@READERS.register("safetensors-sharded")
def _read_safetensors(src: Source) -> Raw:
    if src.lazy:
        return _open_safetensors(src.target, src.layout, src.path)
    if src.layout == "safetensors-sharded":
        return _read_sharded(src.target, src.layout, src.trust_pickle)
    return _raw("safetensors", src.path, _safetensors(src.target), files=(src.target,))


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
    raw = _raw(layout, src.path, flatten(obj, src.target), files=(src.target,))
    raw.step = step
    raw.mapped = src.target not in _NOT_MAPPED
    return raw


def _raw(layout, path, tensors, files=()) -> Raw:
    return Raw(layout=layout, path=path, tensors=tensors, files=tuple(files),
               shapes={k: (tuple(v.shape), v.dtype) for k, v in tensors.items()})


def flatten(obj, path: str, prefix: str = "") -> dict[str, torch.Tensor]:
    """Every tensor in nested dicts, under dotted keys; other values are skipped."""
    if isinstance(obj, torch.Tensor):
        return {prefix[:-1]: obj}
    if not isinstance(obj, Mapping):
        if prefix:
            return {}
        raise CheckpointError(f"{path}: holds a {type(obj).__name__}, not a state dict; save "
                              "model.state_dict() (optionally under 'model')")
    out: dict[str, torch.Tensor] = {}
    for k, v in obj.items():
        if isinstance(k, str):
            out.update(flatten(v, path, f"{prefix}{k}."))
    if not prefix and not out:
        keys = ", ".join(map(repr, list(obj)[:8])) or "none"
        raise CheckpointError(f"{path}: no tensors found (top-level keys: {keys}); expected a "
                              "state dict, bare or under a key such as 'model'")
    return out


def torch_load(path: str, trust_pickle: bool = False):
    """torch.load, memory-mapped, weights_only unless the sweep trusts this file's pickle."""
    try:
        try:
            return _load(path, weights_only=True)
        except pickle.UnpicklingError as e:
            found = re.search(r"Unsupported global: GLOBAL ([\w.]+)", str(e))
            if not found:
                raise errors.wrap(e, CheckpointError, f"{path}: corrupt checkpoint",
                                  location=path) from None
            if not trust_pickle:
                raise CheckpointError(
                    f"{path}: refused: this pickle needs more than weights_only=True (it "
                    f"references {found.group(1)}), and loading it could run code; re-save it "
                    "as a state dict of tensors or safetensors, or set checkpoint.trust_pickle: "
                    "true in the sweep if you trust this file") from None
            log.warning("checkpoint.trust_pickle: loading %s as a full pickle (it references "
                        "%s); this runs any code the file holds", path, found.group(1))
            warnings.warn(f"rayeval: trusting the pickle of {path} ({found.group(1)})",
                          stacklevel=2)
            return _load(path, weights_only=False)
    except CheckpointError:
        raise
    except (EOFError, zipfile.BadZipFile) as e:
        raise _corrupt(e, f"{path}: truncated or corrupt checkpoint", location=path) from None
    except RuntimeError as e:
        raise errors.wrap(e, CheckpointError, f"{path}: truncated or corrupt checkpoint",
                          location=path) from None
    except Exception as e:   # a damaged pickle stream fails in many ways (IndexError, KeyError...)
        raise _corrupt(e, f"{path}: corrupt checkpoint", location=path) from None


def _corrupt(e: BaseException, what: str, tail: str = "", **fields) -> CheckpointError:
    """``what (Type: line)tail``: the foreign error in parentheses, kept as fields."""
    return CheckpointError(f"{what} ({errors.reason(e, typed=True)}){tail}",
                           cause=type(e).__name__, reason=errors.reason(e), **fields)


_NOT_MAPPED: set[str] = set()      # torch.save files that could not be memory-mapped


def _load(path: str, weights_only: bool):
    try:
        obj = torch.load(path, map_location="cpu", weights_only=weights_only, mmap=True)
        _NOT_MAPPED.discard(path)
        return obj
    except RuntimeError as e:
        if "mmap" not in str(e):
            raise
        _NOT_MAPPED.add(path)          # a legacy (non-zip) file: read whole
        return torch.load(path, map_location="cpu", weights_only=weights_only)


def release(raw: Raw, key: str, start: int, stop: int) -> None:
    """Let go of the file pages behind rows ``start:stop`` of a memory-mapped torch.save
    tensor once they were copied: they stop counting in this process's memory (and are read
    from the file again if touched). Nothing for other layouts (read without a memory map)."""
    if not raw.mapped or raw.tensors is None or sys.platform != "linux":
        return
    t = raw.tensors[key]
    part = t if t.dim() == 0 else t[start:stop]
    if not part.numel() or not part.is_contiguous():
        return
    import ctypes
    import mmap

    begin = part.data_ptr()
    lo = begin - begin % mmap.PAGESIZE
    size = begin + part.numel() * part.element_size() - lo
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise(ctypes.c_void_p(lo), ctypes.c_size_t(size), 4)       # MADV_DONTNEED


def _safetensors(path: str) -> dict[str, torch.Tensor]:
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    try:
        return load_file(path, device="cpu")
    except (SafetensorError, OSError, ValueError) as e:
        raise errors.wrap(e, CheckpointError, f"{path}: corrupt safetensors file",
                          location=path) from None


def _read_sharded(index: str, layout: str, trust_pickle: bool) -> Raw:
    try:
        with open(index, encoding="utf-8") as f:
            weight_map = json.load(f)["weight_map"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise _corrupt(e, f"{index}: not a valid shard index",
                       "; expected JSON with a weight_map", location=index) from None
    folder = os.path.dirname(index)
    tensors: dict[str, torch.Tensor] = {}
    shards = sorted(set(weight_map.values()))
    for shard in shards:
        path = os.path.join(folder, shard)
        if not os.path.exists(path):
            raise CheckpointError(f"{index}: shard {shard} is missing")
        part = _safetensors(path) if sniff_file(path) == "safetensors" else \
            flatten(torch_load(path, trust_pickle), path)
        tensors.update(part)
    missing = sorted(set(weight_map) - set(tensors))
    if missing:
        raise CheckpointError(f"{index}: tensors listed in the index are in no shard: "
                              f"{', '.join(missing[:5])}")
    return _raw(layout, os.path.dirname(index), tensors,
                files=(index,) + tuple(os.path.join(folder, s) for s in shards))


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


_ST_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16,
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
        if entry.get("dtype") not in _ST_DTYPES:
            raise CheckpointError(f"{path}: tensor {key} has dtype {entry.get('dtype')!r}, "
                                  "which rayeval cannot read sliced")
        out[key] = (path, 8 + length + int(entry["data_offsets"][0]), _ST_DTYPES[entry["dtype"]],
                    tuple(entry["shape"]))
    return out


def _open_safetensors(target: str, layout: str, path: str) -> Raw:
    if layout == "safetensors":
        files = [target]
    else:
        try:
            with open(target, encoding="utf-8") as f:
                weight_map = json.load(f)["weight_map"]
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise _corrupt(e, f"{target}: not a valid shard index",
                           "; expected JSON with a weight_map", location=target) from None
        folder = os.path.dirname(target)
        files = [os.path.join(folder, s) for s in sorted(set(weight_map.values()))]
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


# --- torch.distributed.checkpoint -----------------------------------------------------------

# DCP writes .metadata with plain pickle and torch reads it back with pickle.load, which runs
# whatever the file asks for. Only the classes DCP itself writes are allowed here.
_DCP_GLOBALS = {
    "torch.distributed.checkpoint.metadata": None,           # any class of this module
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch.serialization": {"_get_layout"},
    "torch": {"Size"},                                          # + dtypes, checked below
    "pathlib": {"PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath"},
    "collections": {"OrderedDict"},
}


class _MetadataUnpickler(pickle.Unpickler):
    def __init__(self, file, path: str):
        super().__init__(file)
        self.path = path

    def find_class(self, module: str, name: str):
        allowed = module in _DCP_GLOBALS and (
            _DCP_GLOBALS[module] is None or name in _DCP_GLOBALS[module]
            or (module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)))
        if not allowed:
            raise CheckpointError(
                f"{self.path}: refused: its .metadata pickle references {module}.{name}, which "
                "torch.distributed.checkpoint never writes; loading it could run code")
        return super().find_class(module, name)


class _SafeDCPReader(FileSystemReader):
    """A FileSystemReader whose .metadata is unpickled with an allow-list."""

    def read_metadata(self, *args, **kwargs):
        with self.fs.create_stream(self._get_metadata_path(kwargs.get("rank")), "rb") as f:
            metadata = _MetadataUnpickler(f, str(self.path)).load()
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


def _read_dcp_metadata(path: str) -> Raw:
    try:
        reader = _SafeDCPReader(path)
        metadata = reader.read_metadata()
    except CheckpointError:
        raise
    except Exception as e:
        raise errors.wrap(e, CheckpointError, f"{path}: corrupt torch.distributed.checkpoint "
                          "metadata", typed=True, location=path) from None
    shapes = {k: (tuple(m.size), m.properties.dtype)
              for k, m in metadata.state_dict_metadata.items()
              if isinstance(m, TensorStorageMetadata)}
    files = tuple(sorted(os.path.join(path, f) for f in os.listdir(path) if f.endswith(".distcp")))
    return Raw(layout="dcp", path=path, shapes=shapes, files=files, reader=reader)


def read_dcp_tensors(raw: Raw, keys: list[str]) -> dict[str, torch.Tensor]:
    """Only the named tensors of a DCP checkpoint (not its optimizer state), however many ranks
    wrote it, without a process group."""
    buffers = {k: torch.empty(raw.shapes[k][0], dtype=raw.shapes[k][1]) for k in keys}
    try:
        with warnings.catch_warnings():   # "assuming the intent is to load in a single process"
            warnings.simplefilter("ignore", UserWarning)
            dcp.load(buffers, storage_reader=raw.reader, no_dist=True)
    except (Exception, CheckpointException) as e:   # the latter is a BaseException
        raise CheckpointError(f"{raw.path}: cannot read torch.distributed.checkpoint shards "
                              f"(missing or truncated .distcp file?): {dcp_failure(e)}"
                              ) from None
    return buffers


def dcp_failure(e: BaseException) -> str:
    """The underlying error of a DCP load failure, in one line."""
    if isinstance(e, CheckpointException) and e.failures:
        inner = next(iter(e.failures.values()))
        if isinstance(inner, tuple):      # (exception, traceback) on some versions
            inner = inner[0]
        e = inner
    return errors.reason(e, typed=True, last=True)
