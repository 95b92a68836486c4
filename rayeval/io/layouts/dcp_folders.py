"""torch.distributed.checkpoint folders (.metadata + __R_I.distcp, any number of ranks): the
metadata unpickled with an allow-list, the named tensors read without a process group."""

from __future__ import annotations

import os
import pickle
import warnings

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import StorageMeta, TensorStorageMetadata

from rayeval import errors
from rayeval.errors import CheckpointError
from rayeval.io.layouts.raw import Raw


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
