"""A sweep's own modules in a process that outlives the run: ``rayeval serve`` and its
standing workers.

A sweep imports its own Python files by name (``model.factory: my_models:build_mlp``, a
``module:Class`` metric, a transform), from the sweep file's folder. A one-run process
imports them once; a process that serves sweep after sweep must not keep them: the next
sweep's ``my_models`` may be another folder's file of the same name, or the same file
edited, and its cells' keys are taken from the files on disk (``io.model.source_digest``).
So each run starts without them: ``mark`` records what the process holds when it is ready
(Python, the installed packages, rayeval, the plugins), and ``forget`` drops every module
imported since from a file outside those places, and the folders put on ``sys.path`` for
them.
"""

from __future__ import annotations

import importlib
import os
import sys
import sysconfig

_KEPT: set[str] = set()          # the modules ``mark`` found
_PATH: list[str] = []            # sys.path as ``mark`` found it
_INSTALLED: tuple[str, ...] = ()  # where installed code lives (never forgotten)


def mark() -> None:
    """What this process holds now is kept by ``forget`` (called once it is set up)."""
    global _INSTALLED
    _KEPT.clear()
    _KEPT.update(sys.modules)
    _PATH[:] = sys.path
    paths = sysconfig.get_paths()
    places = {paths[k] for k in ("stdlib", "platstdlib", "purelib", "platlib") if k in paths}
    places.add(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))   # rayeval
    _INSTALLED = tuple(os.path.join(os.path.realpath(p), "") for p in places)


def users() -> list[str]:
    """The modules imported since ``mark`` from a sweep's own files."""
    found = []
    # a copy in one call: list(items()) failed with "dictionary changed size during
    # iteration" while another thread (Ray's, in a run on a standing group) imported
    for name, module in sys.modules.copy().items():
        if name in _KEPT:
            continue
        path = getattr(module, "__file__", None)
        if path and not os.path.realpath(path).startswith(_INSTALLED or ("\0",)):
            found.append(name)
    return found


def forget() -> list[str]:
    """Drop the sweep's own modules imported since ``mark`` (and the folders added to
    ``sys.path`` for them): the next import reads the files again. Returns their names.
    Without a ``mark`` (a one-run worker), nothing is marked as kept: only what ``users``
    finds outside the installed places is dropped."""
    if not _INSTALLED:
        mark()
        return []
    names = users()
    for name in names:
        sys.modules.pop(name, None)
    if _PATH:
        sys.path[:] = [p for p in sys.path if p in _PATH] + \
            [p for p in _PATH if p not in sys.path]
    importlib.invalidate_caches()
    return names


def stamp() -> str:
    """The sweep's own modules imported since ``mark`` as one string of their files' paths,
    sizes and modification times ("" before a ``mark``): what changes when one is edited."""
    if not _INSTALLED:
        return ""
    found = []
    for name in sorted(users()):
        path = getattr(sys.modules.get(name), "__file__", None) or ""
        try:
            st = os.stat(path)
            found.append(f"{name}={path}:{st.st_size}:{st.st_mtime_ns}")
        except OSError:
            found.append(f"{name}={path}:gone")
    return ";".join(found)
