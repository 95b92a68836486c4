"""torch.save files (zip or legacy, Lightning's .ckpt too): loaded memory-mapped with
``weights_only`` unless the sweep trusts the file's pickle, flattened to dotted keys, and their
file pages let go of once copied."""

from __future__ import annotations

import logging
import pickle
import re
import sys
import warnings
import zipfile
from typing import Mapping

from rayeval import errors
from rayeval.errors import CheckpointError
from rayeval.io.layouts.raw import Raw, corrupt
from rayeval.lazy import lazy_module

torch = lazy_module("torch")        # imported on first use (rayeval.lazy)

log = logging.getLogger("rayeval")


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
        raise corrupt(e, f"{path}: truncated or corrupt checkpoint", location=path) from None
    except RuntimeError as e:
        raise errors.wrap(e, CheckpointError, f"{path}: truncated or corrupt checkpoint",
                          location=path) from None
    except Exception as e:   # a damaged pickle stream fails in many ways (IndexError, KeyError...)
        raise corrupt(e, f"{path}: corrupt checkpoint", location=path) from None


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
