"""Plugins: installed packages that add tasks, metrics, checkpoint layouts or backends to
rayeval's registries, found through the entry-point group ``rayeval.plugins``.

A plugin package declares one entry point per register function::

    [project.entry-points."rayeval.plugins"]
    example = "rayeval_example_plugin:register"

``load_plugins()`` imports each entry point of the group and calls it, with no arguments, once
per process, in every process that looks names up: the driver before a sweep is read (task
and metric names are checked against the registries then) or checked, the command line before
the commands that read a sweep or a checkpoint, every Ray Train worker at the start of its
train function, a Ray Data stage that tokenizes a text task's rows. Later calls return what the
first one loaded. A plugin
that cannot be imported, is not callable, raises, or registers a name that is already taken is
one line naming the entry point and its package (a ``RegistryError``); that failure is kept
and raised again by every later call in the process, so a run never goes on with half a
plugin. ``docs/plugins.md`` shows how to write one.

Who registered what: while a plugin's register function runs (``registering``), every entry a
registry takes is recorded as that plugin's (``config.registry.Registry.origin``), unless the
object is rayeval's own (a built-in imported on the way); an entry registered outside it whose
module lies in a loaded plugin's package is that plugin's too. A cell's content key holds the
distribution's name and version and a digest of the plugin's source (``Origin.ident``) for each
plugin entry the cell uses (``plan.cells.plugin_code``).

The model is vLLM's ``load_general_plugins`` (group ``vllm.general_plugins``, a function per
entry point, a flag per process). Entry points are loaded in name order, so which plugin's
registration comes first does not depend on the order of folders on ``sys.path``.

rayeval's own slices (lm-eval, lmms-eval) register the same way without entry points: the
package root names their register functions (``builtin``) and the task registry's import calls
them (``load_builtins``).

Standard library and the errors only: the base layer, callable from every layer above.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import hashlib
import importlib.util
import os
import sys
import threading
from dataclasses import dataclass
from typing import Any, Iterator

from rayeval import errors
from rayeval.errors import RayevalError, RegistryError

GROUP = "rayeval.plugins"


@dataclass(frozen=True)
class Plugin:
    """One loaded entry point: its name, its target ("module:function") and the package
    (distribution) that declares it, with that package's version."""
    name: str
    value: str
    package: str
    version: str

    def __str__(self) -> str:
        return f"plugin {self.name!r} ({self.value} from {self.package} {self.version})"

    @property
    def top(self) -> str:
        """The top-level import package (or module) its register function lives in."""
        return self.value.partition(":")[0].split(".")[0]


# What this process loaded (None: load_plugins has not run yet) and the failure that stopped
# it, raised again on every later call.
_loaded: tuple[Plugin, ...] | None = None
_failure: RayevalError | None = None
_LOCK = threading.RLock()   # re-entrant: a plugin calling load_plugins gets what is loaded so far


def load_plugins() -> tuple[Plugin, ...]:
    """Import and call every ``rayeval.plugins`` entry point, once per process; the plugins
    loaded. Raises a one-line RegistryError naming the entry point that failed."""
    global _loaded, _failure
    with _LOCK:              # a Ray Data actor may tokenize in several threads at once
        if _failure is not None:
            raise _failure
        if _loaded is not None:
            return _loaded
        _loaded = ()         # set first: a plugin that calls load_plugins again does not recurse
        try:
            for entry in _entry_points():
                _loaded += (_load(entry),)
        except RayevalError as e:
            _failure = e
            raise
        return _loaded


def loaded() -> tuple[Plugin, ...]:
    """The plugins this process has loaded so far (none before ``load_plugins``)."""
    return _loaded or ()


# The slices rayeval ships (lm-evaluation-harness, lmms-eval), registered as a plugin registers:
# one function per slice that names its task, metrics and sweep-entry kind by reference, called
# once per process. The table is filled by the package's root (``rayeval/__init__.py``, which
# every import of a rayeval module runs first and which stands above every floor of the
# ladder), so that this floor holds the mechanism and names no slice; the functions run when the
# task registry is first imported (``core.tasks``), so the registries keep their order (built-in
# tasks, then lm_eval, then lmms_eval) and ``import rayeval`` imports no slice, torch or Ray.
# Not the ``rayeval.plugins`` entry points: a source checkout (PYTHONPATH, a Ray job's
# working_dir, a folder carried to another machine) has no installed metadata, and a built-in
# name must resolve there; ``loaded()`` stays the installed plugins.
_BUILTIN: dict[str, str] = {}       # slice name -> its register function, "module:function"
_builtin_done: set[str] = set()
_builtin_failure: RayevalError | None = None
_builtin_running = False


def builtin(name: str, ref: str) -> None:
    """Name a built-in slice's register function ("module:function"), called by
    ``load_builtins``; a name given twice is refused."""
    if name in _BUILTIN:
        raise RegistryError(f"built-in slice {name!r} is named twice: {_BUILTIN[name]} and "
                            f"{ref}", kind="slice", name=name)
    _BUILTIN[name] = ref


def load_builtins() -> None:
    """Call every built-in slice's register function not called yet in this process, in the
    table's order. A call made while they run (a slice's function imports the task registry,
    whose import asks for the slices) returns at once: the outer call goes on in order."""
    global _builtin_failure, _builtin_running
    with _LOCK:
        if _builtin_failure is not None:
            raise _builtin_failure
        if _builtin_running:
            return
        _builtin_running = True
        try:
            for name, ref in list(_BUILTIN.items()):
                if name not in _builtin_done:
                    _builtin_done.add(name)
                    _call_builtin(name, ref)
        except RayevalError as e:
            _builtin_failure = e
            raise
        finally:
            _builtin_running = False


def _call_builtin(name: str, ref: str) -> None:
    import importlib

    module, _, attr = ref.partition(":")
    try:
        getattr(importlib.import_module(module), attr)()
    except RegistryError as e:
        raise RegistryError(f"built-in slice {name!r} ({ref}): {e.message}",
                            errors.traceback_of(e), **e.fields()) from None
    except Exception as e:
        raise RegistryError(f"built-in slice {name!r} ({ref}) cannot be registered "
                            f"({errors.reason(e, typed=True)}); reinstall rayeval",
                            errors.traceback_of(e), kind="slice", name=name,
                            cause=type(e).__name__, reason=errors.reason(e)) from None


def _entry_points() -> list:
    from importlib.metadata import entry_points

    return sorted(entry_points(group=GROUP), key=lambda e: (e.name, e.value))


def _load(entry) -> Plugin:
    """One entry point imported and called; its Plugin."""
    plugin = _describe(entry)
    try:
        register = entry.load()
    except Exception as e:
        raise _error(plugin, f"cannot be imported ({errors.reason(e, typed=True)}); fix it or "
                     f"uninstall {plugin.package}", e) from None
    if not callable(register):
        raise _error(plugin, f"names a {type(register).__name__}, not a function; point the "
                     "entry point at a function taking no arguments that registers what the "
                     "package adds")
    try:
        with registering(plugin):
            register()
    except RegistryError as e:       # a name already taken: the registry's own line, prefixed
        raise RegistryError(f"{plugin}: {e.message}", errors.traceback_of(e),
                            **e.fields()) from None
    except Exception as e:
        raise _error(plugin, f"raised {errors.reason(e, typed=True)}; fix it or uninstall "
                     f"{plugin.package}", e) from None
    return plugin


def _describe(entry) -> Plugin:
    dist = getattr(entry, "dist", None)
    package = getattr(dist, "name", None) or "an unknown package"
    return Plugin(entry.name, entry.value, package, getattr(dist, "version", None) or "?")


def _error(plugin: Plugin, what: str, cause: BaseException | None = None) -> RegistryError:
    """The one-line error for a plugin that failed; the traceback as ``--debug`` detail."""
    fields: dict[str, Any] = {"kind": "plugin", "name": plugin.name}
    if cause is not None:
        fields.update(cause=type(cause).__name__, reason=errors.reason(cause))
    return RegistryError(f"{plugin} {what}",
                         errors.traceback_of(cause) if cause is not None else None, **fields)


# --- who registered what ----------------------------------------------------------------------

# The plugin whose register function runs now, in this thread (a Ray Data actor may look names
# up in another thread meanwhile: its registrations are not the plugin's).
_registering: contextvars.ContextVar[Plugin | None] = contextvars.ContextVar(
    "rayeval_registering", default=None)


@contextlib.contextmanager
def registering(plugin: Plugin) -> Iterator[None]:
    """Entries registered inside are ``plugin``'s (``load_plugins`` runs each register
    function in it; a test marks a fake plugin's registrations with it)."""
    token = _registering.set(plugin)
    try:
        yield
    finally:
        _registering.reset(token)


@dataclass(frozen=True)
class Origin:
    """Who registered a registry's entry: the plugin, and the module the registered object is
    defined in (a lazy entry's: its reference's)."""
    plugin: Plugin
    module: str

    def ident(self) -> dict[str, str]:
        """What a cell's key holds of it: the distribution, its version and the source digest."""
        return {"package": self.plugin.package, "version": self.plugin.version,
                "source": source_digest(self.plugin.top, self.module)}


def registrant(module: str) -> Plugin | None:
    """The plugin an entry defined in ``module`` is registered by now: the one whose register
    function runs, or None outside one or for rayeval's own objects."""
    return None if _ours(module) else _registering.get()


def origin(plugin: Plugin | None, module: str) -> Origin | None:
    """An entry's Origin from what its registry recorded (the plugin registering it then, and
    its module); without a plugin then, the loaded plugin whose package holds the module (a
    plugin module imported before ``load_plugins`` registers outside it). None: rayeval's own,
    or a test's or a user's in-process registration."""
    if _ours(module):
        return None
    if plugin is None:
        top = module.split(".")[0]
        plugin = next((p for p in loaded() if p.top == top), None)
    return None if plugin is None else Origin(plugin, module)


def _ours(module: str) -> bool:
    return module == "rayeval" or module.startswith("rayeval.")


@functools.lru_cache(maxsize=None)
def source_digest(top: str, module: str) -> str:
    """A digest of a plugin entry's source, hashed once per process (the code a process runs
    is the code it imported): every ``.py`` file under the plugin's top-level package ``top``
    (its relative path and bytes) when ``module`` is inside it, so an edit of the registered
    class's module or of a helper it imports from the package is a new digest; only
    ``module``'s own file when it is outside (an object a plugin registers from another
    package). Empty when there is no source file (an extension module, a zip)."""
    inside = module.split(".")[0] == top
    file, folders = _where(top if inside else module)
    h = hashlib.sha256()
    found = False
    for name, path in (_sources(folders) if inside and folders else
                       [(os.path.basename(file), file)] if file else []):
        try:
            with open(path, "rb") as f:
                data = f.read()
        except OSError:
            continue
        h.update(f"{name}\0{len(data)}\0".encode() + data)
        found = True
    return h.hexdigest()[:16] if found else ""


def forget_digests() -> None:
    """Forget the source digests hashed so far: what a new process would hash (tests)."""
    source_digest.cache_clear()


def _where(name: str) -> tuple[str | None, list[str]]:
    """A module's source file and, for a package, its folders; the imported module's first,
    else found without importing it (a lazy entry's, not asked for yet)."""
    mod = sys.modules.get(name)
    if mod is not None:
        return getattr(mod, "__file__", None), list(getattr(mod, "__path__", None) or [])
    try:
        spec = importlib.util.find_spec(name)
    except (ImportError, ValueError):
        return None, []
    if spec is None:
        return None, []
    return (spec.origin if spec.has_location else None), list(
        spec.submodule_search_locations or [])


def _sources(folders: list[str]) -> list[tuple[str, str]]:
    """Every .py file under a package's folders: (path relative to its folder, path), sorted,
    so where the package is installed does not change the digest."""
    found = []
    for folder in folders:
        for root, dirs, files in os.walk(folder):
            dirs[:] = sorted(d for d in dirs if d != "__pycache__")
            found += [(os.path.relpath(os.path.join(root, f), folder), os.path.join(root, f))
                      for f in files if f.endswith(".py")]
    return sorted(found)
