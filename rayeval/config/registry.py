"""Named registries: tasks, each task's metrics, checkpoint layouts' readers.

A registry maps a name to the thing it names, in registration order. Registering a name twice is
refused (two classes claiming ``accuracy`` would make a sweep's meaning depend on import order),
and asking for a name it does not hold is one line listing the names it does hold::

    TASKS = Registry("task")

    @TASKS.register()            # the name from the class's ``name`` attribute
    class Classification(Task):
        name = "classification"

    TASKS.get("classification")  # the object registered (a class, or an instance: see register)
    TASKS.get("clasification")   # RegistryError: unknown task 'clasification'; choose one of: ...

A name may also be registered by reference, ``"module:Class"``, imported the first time the
name is asked for (vLLM's lazy model registry): a plugin (``rayeval.config.plugins``) can offer
a backend without importing what the backend needs until a sweep uses it::

    BACKENDS.add_lazy("echo", "my_plugin.echo:EchoBackend")

Each entry remembers who registered it (``origin``): an installed plugin (while its register
function runs, ``config.plugins.registering``) or rayeval itself; a cell's content key holds the
code of the plugin entries it uses.

Plain Python, no imports beyond the errors and the plugins' bookkeeping: every layer may hold a
registry.
"""

from __future__ import annotations

import importlib
from typing import Any, Callable, Generic, Iterator, TypeVar

from rayeval import errors
from rayeval.config import plugins
from rayeval.errors import RegistryError

T = TypeVar("T")


class Registry(Generic[T]):
    """Names to objects, in registration order; ``kind`` names them in messages ("task",
    "metric for task 'regression'", "checkpoint layout")."""

    def __init__(self, kind: str):
        self.kind = kind
        self._items: dict[str, T] = {}
        # name -> (the plugin whose register function ran when it was registered, or None;
        # the module of what it registered): ``origin`` reads it.
        self._registrants: dict[str, tuple[plugins.Plugin | None, str]] = {}

    def add(self, name: str, obj: T) -> T:
        """Register ``obj`` as ``name``; a name already taken is a RegistryError naming both."""
        if not isinstance(name, str) or not name:
            raise RegistryError(f"a {self.kind} needs a non-empty name, got {name!r} for "
                                f"{_describe(obj)}", kind=self.kind)
        if name in self._items:
            raise RegistryError(f"{self.kind} {name!r} is registered twice: by "
                                f"{_describe(self._items[name])} and by {_describe(obj)}; "
                                "give one of them another name", kind=self.kind, name=name)
        self._items[name] = obj
        module = _module_of(obj)
        self._registrants[name] = (plugins.registrant(module), module)
        return obj

    def origin(self, name: str) -> plugins.Origin | None:
        """The plugin that registered ``name`` and the module it came from; None for
        rayeval's own entries, a name registered in-process by a user or a test, or a name
        this registry does not hold."""
        if name not in self or name not in self._registrants:
            return None
        return plugins.origin(*self._registrants[name])

    def add_lazy(self, name: str, ref: str, *, instance: bool = False) -> None:
        """Register ``ref`` ("module:Class") as ``name``, imported when the name is first asked
        for (``instance``: ``Class()`` is registered then). A taken name is refused now."""
        module, _, attr = ref.partition(":") if isinstance(ref, str) else ("", "", "")
        if not module or not attr or ":" in attr:
            raise RegistryError(f"{self.kind} {name!r}: expected a 'module:Class' reference, "
                                f"got {ref!r}", kind=self.kind, name=name)
        self.add(name, _Lazy(ref, instance))

    def register(self, name: str | None = None, *, instance: bool = False
                 ) -> Callable[[Any], Any]:
        """A decorator registering what it decorates under ``name`` (default: its ``name``
        attribute). ``instance``: register ``cls()`` instead of the class (tasks are used as
        instances); the decorated class is returned unchanged either way."""
        def decorate(obj):
            key = name if name is not None else getattr(obj, "name", None)
            self.add(key, obj() if instance else obj)
            return obj
        return decorate

    def get(self, name: str) -> T:
        """The object registered as ``name``; a RegistryError listing the known names if none."""
        try:
            obj = self._items[name]
        except (KeyError, TypeError):      # TypeError: an unhashable name from a YAML file
            raise RegistryError(self.unknown(name), kind=self.kind, name=name) from None
        if isinstance(obj, _Lazy):
            obj = self._items[name] = obj.resolve(self.kind, name)
        return obj

    def unknown(self, name: Any) -> str:
        """The message for a name this registry does not hold (callers add the key path)."""
        return f"unknown {self.kind} {name!r}; choose one of: {', '.join(self._items) or 'none'}"

    __getitem__ = get

    def __contains__(self, name: object) -> bool:
        try:
            return name in self._items
        except TypeError:
            return False

    def __iter__(self) -> Iterator[str]:
        return iter(list(self._items))

    def __len__(self) -> int:
        return len(self._items)

    def names(self) -> list[str]:
        return list(self._items)

    def items(self) -> list[tuple[str, T]]:
        return [(name, self.get(name)) for name in list(self._items)]

    def values(self) -> list[T]:
        return [obj for _, obj in self.items()]

    def __repr__(self) -> str:
        return f"Registry({self.kind!r}: {', '.join(self._items)})"


class _Lazy:
    """A name's object by reference, until it is first asked for."""

    def __init__(self, ref: str, instance: bool):
        self.ref, self.instance = ref, instance

    def resolve(self, kind: str, name: str) -> Any:
        module, _, attr = self.ref.partition(":")
        try:
            obj = getattr(importlib.import_module(module), attr)
            return obj() if self.instance else obj
        except Exception as e:
            raise RegistryError(f"{kind} {name!r} ({self.ref}) cannot be loaded "
                                f"({errors.reason(e, typed=True)}); install the package that "
                                "provides it, or fix the reference", errors.traceback_of(e),
                                kind=kind, name=name, cause=type(e).__name__,
                                reason=errors.reason(e)) from None


def _module_of(obj: Any) -> str:
    """The module a registered object is defined in (a reference's module, an instance's
    class's)."""
    if isinstance(obj, _Lazy):
        return obj.ref.partition(":")[0]
    target = obj if isinstance(obj, type) or callable(obj) and hasattr(obj, "__qualname__") \
        else type(obj)
    return str(getattr(target, "__module__", None) or "")


def _describe(obj: Any) -> str:
    """Where a registered object comes from, for the duplicate message."""
    if isinstance(obj, _Lazy):
        return obj.ref
    target = obj if isinstance(obj, type) or callable(obj) and hasattr(obj, "__qualname__") \
        else type(obj)
    return f"{getattr(target, '__module__', '?')}.{getattr(target, '__qualname__', repr(obj))}"
