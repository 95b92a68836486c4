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

Plain Python, no imports beyond the errors: every layer may hold a registry.
"""

from __future__ import annotations

import importlib
from typing import Any, Callable, Generic, Iterator, TypeVar

from rayeval.errors import RegistryError

T = TypeVar("T")


class Registry(Generic[T]):
    """Names to objects, in registration order; ``kind`` names them in messages ("task",
    "metric for task 'regression'", "checkpoint layout")."""

    def __init__(self, kind: str):
        self.kind = kind
        self._items: dict[str, T] = {}
        self._lazy: dict[str, str] = {}       # name -> "module:attr", imported on first use

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
        return obj

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

    def lazy(self, name: str, target: str) -> None:
        """Name ``target`` ("module:attr", a module that registers ``name`` when imported)
        without importing it: a registry low on the ladder can hold a thing defined higher up
        (vLLM's lazy model registry), found by name in any process."""
        self._lazy[name] = target

    def _load(self, name: Any) -> None:
        """Import the module of a lazily named entry, once; it registers itself."""
        try:
            target = self._lazy.pop(name, None)
        except TypeError:                   # an unhashable name from a YAML file
            return
        if target is not None and name not in self._items:
            importlib.import_module(target.split(":", 1)[0])

    def get(self, name: str) -> T:
        """The object registered as ``name``; a RegistryError listing the known names if none."""
        self._load(name)
        try:
            return self._items[name]
        except (KeyError, TypeError):      # TypeError: an unhashable name from a YAML file
            raise RegistryError(self.unknown(name), kind=self.kind, name=name) from None

    def unknown(self, name: Any) -> str:
        """The message for a name this registry does not hold (callers add the key path)."""
        return f"unknown {self.kind} {name!r}; choose one of: {', '.join(self) or 'none'}"

    __getitem__ = get

    def __contains__(self, name: object) -> bool:
        try:
            return name in self._items or name in self._lazy
        except TypeError:
            return False

    def __iter__(self) -> Iterator[str]:
        return iter(self.names())

    def __len__(self) -> int:
        return len(self.names())

    def names(self) -> list[str]:
        return list(self._items) + [n for n in self._lazy if n not in self._items]

    def items(self) -> list[tuple[str, T]]:
        return [(n, self.get(n)) for n in self.names()]

    def values(self) -> list[T]:
        return [self.get(n) for n in self.names()]

    def __repr__(self) -> str:
        return f"Registry({self.kind!r}: {', '.join(self._items)})"


def _describe(obj: Any) -> str:
    """Where a registered object comes from, for the duplicate message."""
    target = obj if isinstance(obj, type) or callable(obj) and hasattr(obj, "__qualname__") \
        else type(obj)
    return f"{getattr(target, '__module__', '?')}.{getattr(target, '__qualname__', repr(obj))}"
