"""Building the sweep's model from its ``module:callable`` factory."""

from __future__ import annotations

import importlib
import sys
from typing import Callable

import torch

from .errors import ModelError, traceback_of
from .config import ModelSpec


def import_callable(ref: str, base_dir: str, what: str = "model.factory") -> Callable:
    """Import ``module:attr``, looking next to the sweep file first, then on sys.path."""
    module_name, _, attr = ref.partition(":")
    if base_dir and base_dir not in sys.path:
        sys.path.insert(0, base_dir)
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        if e.name and module_name.startswith(e.name):
            raise ModelError(
                f"{what}: cannot import module {module_name!r}: put {module_name}.py next to the "
                f"sweep file ({base_dir}) or on PYTHONPATH") from None
        raise ModelError(f"{what}: importing {module_name!r} failed: {e}",
                         traceback_of(e)) from None
    except Exception as e:  # the user's module raised while being imported
        raise ModelError(f"{what}: importing {module_name!r} raised "
                         f"{type(e).__name__}: {e}", traceback_of(e)) from None
    obj = module
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise ModelError(f"{what}: module {module_name!r} has no attribute {attr!r}; "
                             "check the name after ':'")
        obj = getattr(obj, part)
    if not callable(obj):
        raise ModelError(f"{what}: {ref!r} is not callable")
    return obj


def build_model(spec: ModelSpec, base_dir: str, device: torch.device | str = "cpu"
                ) -> torch.nn.Module:
    """Call the factory with its kwargs under ``device`` (``"meta"`` builds without memory)."""
    factory = import_callable(spec.factory, base_dir)
    try:
        with torch.device(device):
            model = factory(**spec.kwargs)
    except TypeError as e:
        raise ModelError(f"model.factory: calling {spec.factory} with model.kwargs "
                         f"{spec.kwargs} failed: {e}", traceback_of(e)) from None
    except Exception as e:
        raise ModelError(f"model.factory: {spec.factory}(**{spec.kwargs}) raised "
                         f"{type(e).__name__}: {e}", traceback_of(e)) from None
    if not isinstance(model, torch.nn.Module):
        raise ModelError(f"model.factory: {spec.factory} returned {type(model).__name__}, "
                         "not a torch.nn.Module")
    return model.eval()


def source_digest(ref: str, base_dir: str) -> str:
    """A digest of the source file of the module a ``module:callable`` lives in, so a cell's
    content key changes when the user's factory, transform or metric code does. Empty for a
    module without a source file (a built-in or an installed extension)."""
    import hashlib

    obj = import_callable(ref, base_dir)
    module = sys.modules.get(getattr(obj, "__module__", "") or ref.partition(":")[0])
    path = getattr(module, "__file__", None)
    if not path or not path.endswith(".py"):
        return ""
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()[:16]
