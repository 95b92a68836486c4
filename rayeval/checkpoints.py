"""Checkpoints: found from globs, their format detected from their bytes, loaded safely.

Layouts read here:
  * ``torch.save`` files (zip or legacy pickle) holding a state dict, bare or under ``model``,
    ``state_dict`` or ``model_state_dict`` -- always ``torch.load(weights_only=True)``;
  * safetensors files;
  * ``torch.distributed.checkpoint`` folders (``.metadata`` + ``__R_I.distcp``), as FSDP writes
    them, from any number of ranks; read without a process group.
Keys may carry the ``module.`` prefix of DDP/DataParallel and the ``_orig_mod.`` prefix of
``torch.compile``. A checkpoint that does not fit the model exactly is an error naming the keys.
"""

from __future__ import annotations

import os
import pickle
import re
import struct
import warnings
import zipfile
from dataclasses import dataclass
from typing import Mapping

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import StorageMeta, TensorStorageMetadata

from . import paths
from .errors import CheckpointError, SpecError

WRAPPER_KEYS = ("model", "state_dict", "model_state_dict")
_STEP_WORD = re.compile(r"(?:^|[^a-z])(?:global_step|step|iter|iteration)[=_-]?(\d+)", re.I)
_DIGITS = re.compile(r"\d+")
_PREFIXES = ("module.", "_orig_mod.")


@dataclass(frozen=True)
class CheckpointRef:
    location: str           # as expanded from the glob (absolute path or URI)
    step: int | None

    @property
    def name(self) -> str:
        return self.location.rstrip("/").rsplit("/", 1)[-1]


def parse_step(location: str) -> int | None:
    """The training step in a checkpoint's name: ``step=N``/``step_N``/``iter-N`` first, else
    the last number in the name (``checkpoint-500`` -> 500); None when there is none."""
    name = location.rstrip("/").rsplit("/", 1)[-1]
    stem = re.sub(r"\.(pt|pth|bin|ckpt|safetensors)$", "", name, flags=re.I)
    m = _STEP_WORD.search(stem)
    if m:
        return int(m.group(1))
    numbers = _DIGITS.findall(stem)
    return int(numbers[-1]) if numbers else None


def expand_checkpoints(patterns: tuple[str, ...], keys: tuple[str, ...] | None = None
                       ) -> list[CheckpointRef]:
    """Every checkpoint the patterns match, once each, ordered by step then location.

    A pattern that matches nothing is a SpecError naming it (``checkpoints[i]``)."""
    seen: dict[str, CheckpointRef] = {}
    for i, pattern in enumerate(patterns):
        found = paths.glob(pattern)
        if not found:
            key = keys[i] if keys else f"checkpoints[{i}]"
            kind = "glob" if paths.has_glob(pattern) else "path"
            raise SpecError(f"{key}: {kind} {pattern!r} matches no file or folder; "
                            "check the path (relative paths start at the sweep file's folder)")
        for location in found:
            seen.setdefault(location, CheckpointRef(location, parse_step(location)))
    return sorted(seen.values(), key=lambda c: (c.step is None, c.step or 0, c.location))


# --- reading -------------------------------------------------------------------------------

def detect_format(path: str) -> str:
    """``"dcp"``, ``"safetensors"`` or ``"torch"``, from the checkpoint's own bytes."""
    if os.path.isdir(path):
        if os.path.exists(os.path.join(path, ".metadata")):
            return "dcp"
        raise CheckpointError(f"{path}: a folder without .metadata is not a "
                              "torch.distributed.checkpoint; point the glob at checkpoint "
                              "files or DCP folders")
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
    raise CheckpointError(f"{path}: not a checkpoint: expected a torch.save file, a "
                          "safetensors file or a torch.distributed.checkpoint folder")


def read_state_dict(path: str) -> dict[str, torch.Tensor]:
    """The tensors of a torch.save or safetensors file (CPU, memory-mapped where possible)."""
    fmt = detect_format(path)
    if fmt == "safetensors":
        from safetensors import SafetensorError
        from safetensors.torch import load_file

        try:
            return load_file(path, device="cpu")
        except (SafetensorError, OSError, ValueError) as e:
            raise CheckpointError(f"{path}: corrupt safetensors file: {e}") from None
    if fmt == "torch":
        return unwrap_state_dict(_torch_load(path), path)
    raise CheckpointError(f"{path}: {fmt} checkpoints are read with load_into(), not "
                          "read_state_dict()")


def _torch_load(path: str):
    try:
        try:
            return torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        except RuntimeError as e:
            if "mmap" not in str(e):
                raise
            return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        detail = str(e).split("\n")[0]
        found = re.search(r"Unsupported global: GLOBAL ([\w.]+)", str(e))
        if found:
            what = f" (it references {found.group(1)})"
            raise CheckpointError(
                f"{path}: refused: this pickle needs more than weights_only=True{what}, and "
                "loading it could run code; re-save it as a state dict of tensors "
                "(torch.save(model.state_dict(), ...)) or as safetensors") from None
        raise CheckpointError(f"{path}: corrupt checkpoint: {detail}") from None
    except (EOFError, zipfile.BadZipFile) as e:
        raise CheckpointError(f"{path}: truncated or corrupt checkpoint ({type(e).__name__}: "
                              f"{e})") from None
    except RuntimeError as e:
        detail = str(e).split("\n")[0]
        raise CheckpointError(f"{path}: truncated or corrupt checkpoint: {detail}") from None
    except Exception as e:   # a damaged pickle stream fails in many ways (IndexError, KeyError...)
        raise CheckpointError(f"{path}: corrupt checkpoint ({type(e).__name__}: {e})") from None


def unwrap_state_dict(obj, path: str) -> dict[str, torch.Tensor]:
    """The state dict inside what torch.save wrote: bare, or under a wrapper key."""
    if not isinstance(obj, Mapping):
        raise CheckpointError(f"{path}: holds a {type(obj).__name__}, not a state dict; save "
                              "model.state_dict() (optionally under 'model')")
    for key in WRAPPER_KEYS:
        inner = obj.get(key)
        if isinstance(inner, Mapping) and any(isinstance(v, torch.Tensor) for v in inner.values()):
            return {k: v for k, v in inner.items() if isinstance(v, torch.Tensor)}
    tensors = {k: v for k, v in obj.items() if isinstance(v, torch.Tensor)}
    if not tensors:
        keys = ", ".join(map(repr, list(obj)[:8])) or "none"
        raise CheckpointError(f"{path}: no state dict found (top-level keys: {keys}); expected "
                              f"tensors, or a state dict under one of {', '.join(WRAPPER_KEYS)}")
    return tensors


def strip_prefixes(key: str) -> str:
    """Drop DDP's ``module.`` and torch.compile's ``_orig_mod.`` wrappers from a key."""
    changed = True
    while changed:
        changed = False
        for prefix in _PREFIXES:
            if key.startswith(prefix):
                key = key[len(prefix):]
                changed = True
    return key.replace("._orig_mod.", ".")


def match_keys(keys, model_keys) -> dict[str, str]:
    """Map checkpoint keys to model keys: as they are, or with wrapper prefixes stripped,
    whichever matches more of the model."""
    model_keys = set(model_keys)
    raw = {k: k for k in keys}
    stripped = {k: strip_prefixes(k) for k in keys}
    if len(model_keys & set(stripped.values())) > len(model_keys & set(raw.values())):
        return stripped
    return raw


def check_fit(path: str, shapes: Mapping[str, tuple], model: torch.nn.Module) -> None:
    """Raise a CheckpointError naming every missing, unexpected and mis-shaped key."""
    expected = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    missing = sorted(set(expected) - set(shapes))
    unexpected = sorted(set(shapes) - set(expected))
    mismatched = sorted(k for k in set(expected) & set(shapes) if tuple(shapes[k]) != expected[k])
    if not (missing or unexpected or mismatched):
        return
    parts = []
    if missing:
        parts.append(f"{len(missing)} missing key(s): {_few(missing)}")
    if unexpected:
        parts.append(f"{len(unexpected)} unexpected key(s): {_few(unexpected)}")
    if mismatched:
        shown = [f"{k} {list(shapes[k])} vs model {list(expected[k])}" for k in mismatched]
        parts.append(f"{len(mismatched)} shape mismatch(es): {_few(shown)}")
    raise CheckpointError(f"{path}: does not fit the model: " + "; ".join(parts)
                          + "; check model.factory and model.kwargs")


def _few(items: list[str], n: int = 5) -> str:
    shown = ", ".join(items[:n])
    return shown + (f" and {len(items) - n} more" if len(items) > n else "")


def load_into(model: torch.nn.Module, path: str) -> str:
    """Load the checkpoint at a local path into ``model`` (strictly); returns its format."""
    fmt = detect_format(path)
    if fmt == "dcp":
        state = _read_dcp(path, model)
    else:
        state = read_state_dict(path)
        mapping = match_keys(state, model.state_dict())
        state = {mapping[k]: v for k, v in state.items()}
    check_fit(path, {k: tuple(v.shape) for k, v in state.items()}, model)
    try:
        model.load_state_dict(state, strict=True)
    except RuntimeError as e:
        raise CheckpointError(f"{path}: cannot load into the model: "
                              f"{str(e).splitlines()[0]}") from None
    return fmt


def _read_dcp(path: str, model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Read only the model's tensors from a DCP folder, whatever wrapper key the trainer used
    (``{"model": ...}``, bare, ...) and however many ranks wrote it."""
    try:
        reader = _SafeDCPReader(path)
        metadata = reader.read_metadata()
    except CheckpointError:
        raise
    except Exception as e:
        raise CheckpointError(f"{path}: corrupt torch.distributed.checkpoint metadata: "
                              f"{type(e).__name__}: {e}") from None
    tensors = {k: m for k, m in metadata.state_dict_metadata.items()
               if isinstance(m, TensorStorageMetadata)}
    model_keys = set(model.state_dict())
    best: tuple[int, str, dict[str, str]] | None = None
    for wrapper in ("",) + tuple(w + "." for w in WRAPPER_KEYS):
        inside = [k for k in tensors if k.startswith(wrapper)]
        mapping = match_keys([k[len(wrapper):] for k in inside], model_keys)
        mapping = {wrapper + k: v for k, v in mapping.items()}
        score = len(model_keys & set(mapping.values()))
        if best is None or score > best[0]:
            best = (score, wrapper, mapping)
    assert best is not None
    _, _, mapping = best
    check_fit(path, {mapping[k]: tuple(tensors[k].size) for k in mapping}, model)
    buffers = {k: torch.empty(tuple(tensors[k].size), dtype=tensors[k].properties.dtype)
               for k in mapping}
    try:
        with warnings.catch_warnings():   # "assuming the intent is to load in a single process"
            warnings.simplefilter("ignore", UserWarning)
            dcp.load(buffers, storage_reader=reader, no_dist=True)
    except (Exception, CheckpointException) as e:   # the latter is a BaseException
        detail = _dcp_failure(e)
        raise CheckpointError(f"{path}: cannot read torch.distributed.checkpoint shards "
                              f"(missing or truncated .distcp file?): {detail}") from None
    return {mapping[k]: v for k, v in buffers.items()}


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


def _dcp_failure(e: BaseException) -> str:
    """The underlying error of a DCP load failure, in one line."""
    if isinstance(e, CheckpointException) and e.failures:
        inner = next(iter(e.failures.values()))
        if isinstance(inner, tuple):      # (exception, traceback) on some versions
            inner = inner[0]
        e = inner
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[-1] if text else ''}"


def fetch(location: str, cache_dir: str) -> str:
    """A local path for a checkpoint location: object-store checkpoints are copied into
    ``cache_dir`` once (keyed by location) and reused."""
    if not paths.is_uri(location):
        return location
    import hashlib

    import pyarrow.fs as pafs

    digest = hashlib.sha256(location.encode()).hexdigest()[:16]
    target = os.path.join(cache_dir, digest, location.rstrip("/").rsplit("/", 1)[-1])
    if os.path.exists(target):
        return target
    fs, src = paths.filesystem(location)
    tmp = target + ".partial"
    os.makedirs(os.path.dirname(target), exist_ok=True)
    try:
        if fs.get_file_info(src).type == pafs.FileType.Directory:
            pafs.copy_files(src, tmp, source_filesystem=fs,
                            destination_filesystem=pafs.LocalFileSystem())
        else:
            with fs.open_input_stream(src) as fin, open(tmp, "wb") as fout:
                while chunk := fin.read(1 << 24):
                    fout.write(chunk)
    except OSError as e:
        raise CheckpointError(f"{location}: cannot fetch the checkpoint: {e}") from None
    os.replace(tmp, target)
    return target
