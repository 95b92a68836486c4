"""Building the sweep's model from its ``module:callable`` factory."""

from __future__ import annotations

import importlib
import os
import sys
from typing import Callable

from rayeval import errors
from rayeval.errors import ModelError, traceback_of
from rayeval.config.reader import did_you_mean
from rayeval.config.schema import ModelSpec
from rayeval.lazy import lazy_module

torch = lazy_module("torch")        # imported on first use (rayeval.lazy)


def import_callable(ref: str, base_dir: str, what: str = "model.factory") -> Callable:
    """Import ``module:attr``, looking next to the sweep file first, then on sys.path."""
    module_name, _, attr = ref.partition(":")
    if base_dir:
        _own_module(module_name, base_dir)
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        if e.name and module_name.startswith(e.name):
            raise ModelError(
                f"{what}: cannot import module {module_name!r}"
                f"{did_you_mean(module_name, _modules_in(base_dir))}; put {module_name}.py next "
                f"to the sweep file ({base_dir}) or on PYTHONPATH") from None
        raise errors.wrap(e, ModelError, f"{what}: importing {module_name!r} failed",
                          detail=traceback_of(e), key_path=what) from None
    except Exception as e:  # the user's module raised while being imported
        raise errors.wrap(e, ModelError, f"{what}: importing {module_name!r} raised",
                          typed=True, sep=" ", detail=traceback_of(e), key_path=what) from None
    obj, done = module, []
    for part in attr.split("."):
        if not hasattr(obj, part):
            names = {".".join([*done, n]) for n in dir(obj) if not n.startswith("_")}
            raise ModelError(f"{what}: module {module_name!r} has no attribute {attr!r}"
                             f"{did_you_mean('.'.join([*done, part]), names)}; check the name "
                             "after ':'")
        obj = getattr(obj, part)
        done.append(part)
    if not callable(obj):
        raise ModelError(f"{what}: {ref!r} is not callable")
    return obj


# The sweep folders' own modules this process imported: name -> (file, mtime_ns) when imported.
_OWN: dict[str, tuple[str, int]] = {}


def _own_module(module_name: str, base_dir: str) -> None:
    """The sweep folder first on sys.path, and its own file of ``module_name`` the one that
    is imported: a process that runs several sweeps (``rayeval.run`` in a notebook, a
    service's driver, a standing worker) may hold another folder's module of the same name
    (two projects' ``my_models``), or this folder's file from before an edit, while the
    cells' keys are read from the files on disk (``source_digest``). Either is dropped, with
    its submodules, and imported again."""
    if sys.path[:1] != [base_dir]:
        if base_dir in sys.path:
            sys.path.remove(base_dir)
        sys.path.insert(0, base_dir)
    top = module_name.partition(".")[0]
    for candidate in (os.path.join(base_dir, top + ".py"),
                      os.path.join(base_dir, top, "__init__.py")):
        try:
            mtime = os.stat(candidate).st_mtime_ns
        except OSError:
            continue
        path = os.path.realpath(candidate)
        held = sys.modules.get(top)
        held_file = getattr(held, "__file__", None)
        if held is not None and (held_file is None or os.path.realpath(held_file) != path
                                 or _OWN.get(top, (path, mtime)) != (path, mtime)):
            for name in [n for n in sys.modules if n == top or n.startswith(top + ".")]:
                del sys.modules[name]
            importlib.invalidate_caches()
        _OWN[top] = (path, mtime)
        return


def _modules_in(folder: str) -> list[str]:
    """The modules a sweep's folder holds (``name.py``), the names a misspelt one is near."""
    try:
        return [n[:-3] for n in os.listdir(folder or ".") if n.endswith(".py")]
    except OSError:
        return []


def build_model(spec: ModelSpec, base_dir: str, device: torch.device | str = "cpu"
                ) -> torch.nn.Module:
    """Call the factory with its kwargs under ``device`` (``"meta"`` builds without memory)."""
    factory = import_callable(spec.factory, base_dir)
    try:
        with torch.device(device):
            model = factory(**spec.kwargs)
    except TypeError as e:
        raise errors.wrap(e, ModelError, f"model.factory: calling {spec.factory} with "
                          f"model.kwargs {spec.kwargs} failed", detail=traceback_of(e),
                          key_path="model.kwargs") from None
    except Exception as e:
        raise errors.wrap(e, ModelError, f"model.factory: {spec.factory}(**{spec.kwargs}) "
                          "raised", typed=True, sep=" ", detail=traceback_of(e),
                          key_path="model.factory") from None
    if not isinstance(model, torch.nn.Module):
        raise ModelError(f"model.factory: {spec.factory} returned {type(model).__name__}, "
                         "not a torch.nn.Module")
    return model.eval()


def source_digest(ref: str, base_dir: str) -> str:
    """A digest of the source file of the module a ``module:callable`` lives in, so a cell's
    content key changes when the user's factory, transform or metric code does. Empty for a
    module without a source file (a built-in or an installed extension).

    Where the file itself defines the callable (a plain top-level ``def`` or ``class``), the
    file is found and read without running it: a fully cached run then never imports the
    user's module, nor the torch it imports (1.3 s). Otherwise (a name imported from elsewhere,
    a decorated function) the module is imported and the file its callable names is read."""
    import hashlib

    path = _defining_file(ref, base_dir)
    if path is None:
        obj = import_callable(ref, base_dir)
        module = sys.modules.get(getattr(obj, "__module__", "") or ref.partition(":")[0])
        path = getattr(module, "__file__", None)
    if not path or not path.endswith(".py"):
        return ""
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()[:16]


def _defining_file(ref: str, base_dir: str) -> str | None:
    """The source file of ``module`` in ``module:name`` when that file binds ``name`` only by
    one undecorated top-level ``def`` or ``class`` (so the callable's ``__module__`` is that
    module), found as an import would find it but not run; None when that cannot be told
    without running it."""
    import importlib.util

    module_name, _, attr = ref.partition(":")
    if not attr or "." in attr or "." in module_name or module_name in sys.modules:
        return None
    if base_dir:
        _own_module(module_name, base_dir)
    try:
        spec = importlib.util.find_spec(module_name)
    except (ImportError, ValueError):
        return None
    path = getattr(spec, "origin", None)
    if not path or not path.endswith(".py"):
        return None
    try:
        stat = os.stat(path)
    except OSError:
        return None
    seen = (path, stat.st_mtime_ns, stat.st_size, attr)   # a service asks again per run
    if seen not in _DEFINES:
        _DEFINES[seen] = _defines(path, attr)
    return path if _DEFINES[seen] else None


_DEFINES: dict[tuple, bool] = {}     # (file, mtime, size, name) -> _defines' answer


def _defines(path: str, attr: str) -> bool:
    """Whether the file binds ``attr`` only by one undecorated top-level def or class."""
    import ast

    try:
        with open(path, "rb") as f:
            tree = ast.parse(f.read(), path)
    except (OSError, SyntaxError, ValueError):
        return False

    def binds(node) -> bool:         # a statement outside a top-level def binding the name
        for n in ast.walk(node):
            if isinstance(n, ast.Name) and n.id == attr and isinstance(n.ctx, ast.Store) or \
                    isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and \
                    n.name == attr or isinstance(n, ast.alias) and \
                    (n.asname or n.name.partition(".")[0]) in (attr, "*"):
                return True
        return False

    found = []
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and \
                node.name == attr:
            found.append(not node.decorator_list)
        elif not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and \
                binds(node):
            found.append(False)
    return found == [True]


class ModelSource:
    """Where a sweep's model comes from: its ``model.factory``, or (without one) each
    checkpoint's Hugging Face folder; and, for text tasks, its tokenizer."""

    def __init__(self, spec: ModelSpec, base_dir: str):
        self.spec = spec
        self.base_dir = base_dir
        self._meta: torch.nn.Module | None = None
        self._hf = None
        if spec.hugging_face:
            from rayeval.io import hf

            self._hf = hf.Builder()
        self._tokenizers: dict[str, object] = {}

    def meta(self, checkpoint: str | None = None) -> torch.nn.Module:
        """The model with its parameters on the meta device: the factory's (built once), or
        the one of the Hugging Face folder at the local path ``checkpoint``."""
        if self._hf is not None:
            if checkpoint is None:
                raise ModelError("a Hugging Face model needs its checkpoint folder")
            return self._hf.meta(checkpoint)
        if self._meta is None:
            self._meta = build_model(self.spec, self.base_dir, "meta")
        return self._meta

    def real(self) -> torch.nn.Module | None:
        """A real CPU build for a probe the meta device cannot run; None for Hugging Face
        folders (their output is known from the config: no build of random weights)."""
        return None if self._hf is not None else build_model(self.spec, self.base_dir, "cpu")

    def loader(self, device: torch.device, checkpoint_spec):
        from rayeval.io.loading import LeanLoader, dtypes

        dtype = dtypes().get(self.spec.dtype)
        if self._hf is not None:
            return LeanLoader(None, device, dtype, checkpoint_spec, builder=self._hf.meta)
        factory = import_callable(self.spec.factory, self.base_dir)
        kwargs = self.spec.kwargs
        return LeanLoader(lambda: factory(**kwargs).eval(), device, dtype, checkpoint_spec)

    def tokenizer(self, checkpoint: str | None, model: torch.nn.Module | None = None):
        """The ``hf.Tokenizer`` for a checkpoint (a local path): ``model.tokenizer``, else the
        checkpoint's folder; loaded once per folder and model length."""
        from rayeval.io import hf

        folder = self.spec.tokenizer or checkpoint
        what = "model.tokenizer" if self.spec.tokenizer else "checkpoint"
        if folder is None:
            raise ModelError("text tasks need a tokenizer: set model.tokenizer")
        cache_key = f"{folder}|{hf.max_length(model, None, self.spec.max_length)}"
        if cache_key not in self._tokenizers:
            from rayeval.io import vision

            # A vision-language folder's tokenizer comes with its processor (image items need
            # it; text items use it as the plain tokenizer it also is).
            load = (vision.load_processor if hf.is_vision_type(vision.model_type(folder))
                    and vision.has_processor(folder) else hf.load_tokenizer)
            self._tokenizers[cache_key] = load(
                folder, what=what, model=model, configured_max=self.spec.max_length)
        return self._tokenizers[cache_key]

    def code_digest(self) -> str:
        """The factory module's source digest (part of cell keys); empty for folders, whose
        config is part of the checkpoint's own fingerprint."""
        return "" if self._hf is not None else source_digest(self.spec.factory, self.base_dir)
