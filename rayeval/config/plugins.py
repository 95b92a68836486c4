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

The model is vLLM's ``load_general_plugins`` (group ``vllm.general_plugins``, a function per
entry point, a flag per process). Entry points are loaded in name order, so which plugin's
registration comes first does not depend on the order of folders on ``sys.path``.

Standard library and the errors only: the base layer, callable from every layer above.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any

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
