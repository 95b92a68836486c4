"""``Raw``: a checkpoint's tensors as every layout's reader returns them (see ``layouts``), and
the one-line error for a corrupt file that the readers share."""

from __future__ import annotations

from dataclasses import dataclass, field

from rayeval import errors
from rayeval.errors import CheckpointError
from rayeval.lazy import lazy_module

torch = lazy_module("torch")        # imported on first use (rayeval.lazy)


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


def from_tensors(layout: str, path: str, tensors: dict, files=()) -> Raw:
    """A checkpoint read whole: ``tensors`` (dotted key -> tensor) as a reader returns them."""
    return Raw(layout=layout, path=path, tensors=tensors, files=tuple(files),
               shapes={k: (tuple(v.shape), v.dtype) for k, v in tensors.items()})


def weight_map(index: str) -> dict[str, str]:
    """A Hugging Face shard index's ``weight_map`` (tensor -> shard file); a corrupt index is
    one line naming it."""
    import json

    try:
        with open(index, encoding="utf-8") as f:
            return json.load(f)["weight_map"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise corrupt(e, f"{index}: not a valid shard index",
                      "; expected JSON with a weight_map", location=index) from None


def corrupt(e: BaseException, what: str, tail: str = "", **fields) -> CheckpointError:
    """``what (Type: line)tail``: the foreign error in parentheses, kept as fields."""
    return CheckpointError(f"{what} ({errors.reason(e, typed=True)}){tail}",
                           cause=type(e).__name__, reason=errors.reason(e), **fields)
