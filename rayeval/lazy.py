"""A module imported when first used: ``torch = lazy_module("torch")`` at the top of a module
whose functions use torch, so that importing the module does not import torch.

Why: a fully cached ``rayeval run`` reads the store and prints the board, and never needs
torch, but the modules that plan it (the task and metric registries, the data's and model's
descriptions) have torch at the top for their other functions: importing torch was 1.3 s of
a 2.5 s cached run (``python -X importtime``, 2-core machine). The same idea as scientific
Python's lazy loading (SPEC 1). Where torch is imported already, ``lazy_module`` returns it
itself; otherwise the stand-in gives way to torch in the module's namespace at its first use.

A lazy module may be named at module level only where nothing reads an attribute of it
there (a module-level ``torch.float32`` imports torch at once): tables of dtypes and default
arguments are built in functions. ``tests/e2e/test_cli.py`` (the quickstart) checks that a
cached run imports no torch.
"""

from __future__ import annotations

import importlib
import sys
import types

_PROXIES: dict[str, types.ModuleType] = {}


class _Lazy(types.ModuleType):
    """Stands for the module ``__name__`` in the namespaces of the modules that asked for it.
    The first attribute read imports the module and puts it in their place, so later reads
    are the module's own, at no cost (a stand-in's ``__getattr__`` costs ~1.5 us a read)."""

    def __init__(self, name: str):
        super().__init__(name)
        self._lazy_holders: list[dict] = []

    def __getattr__(self, attr: str):
        real = sys.modules.get(self.__name__) or importlib.import_module(self.__name__)
        for namespace in self._lazy_holders:
            for key, value in list(namespace.items()):
                if value is self:
                    namespace[key] = real
        return getattr(real, attr)

    def __reduce__(self):               # pickled (a closure sent to a Ray worker) by its name
        return importlib.import_module, (self.__name__,)


def lazy_module(name: str) -> types.ModuleType:
    """The module ``name``, or, where no one has imported it yet, a stand-in for it in the
    calling module's namespace that imports it when an attribute is first read."""
    real = sys.modules.get(name)
    if real is not None:
        return real
    proxy = _PROXIES.setdefault(name, _Lazy(name))
    proxy._lazy_holders.append(sys._getframe(1).f_globals)
    return proxy
