"""Locations: local paths and object-store URIs, resolved and globbed through pyarrow.fs.

A location is a string: an absolute local path or a URI with a scheme (``s3://bucket/key``).
Relative paths in a sweep file are resolved against the sweep file's folder before they get here.
"""

from __future__ import annotations

import fnmatch
import os
import re
from typing import Iterable

import pyarrow.fs as pafs

_SCHEME = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*://")
_GLOB_CHARS = set("*?[")


def is_uri(location: str) -> bool:
    """True for ``scheme://...`` locations (object stores), False for local paths."""
    return bool(_SCHEME.match(location))


def resolve(location: str, base_dir: str) -> str:
    """An absolute local path or an untouched URI; relative paths are taken from ``base_dir``."""
    if is_uri(location):
        return location
    expanded = os.path.expanduser(location)
    if not os.path.isabs(expanded):
        expanded = os.path.join(base_dir, expanded)
    return os.path.normpath(expanded)


def filesystem(location: str) -> tuple[pafs.FileSystem, str]:
    """The pyarrow filesystem for a location and the path inside it."""
    if not is_uri(location):
        return pafs.LocalFileSystem(), os.path.abspath(location)
    fs, path = pafs.FileSystem.from_uri(location)
    return fs, path


def to_location(fs: pafs.FileSystem, path: str, like: str) -> str:
    """Turn a filesystem path back into a location of the same kind as ``like``."""
    if not is_uri(like):
        return path
    scheme = like.split("://", 1)[0]
    return f"{scheme}://{path}"


def has_glob(pattern: str) -> bool:
    return any(c in _GLOB_CHARS for c in pattern)


def glob(pattern: str) -> list[str]:
    """Locations matching a pattern (files and folders), sorted; a plain location matches itself
    when it exists. ``*`` does not cross ``/``; ``**`` does."""
    fs, path = filesystem(pattern)
    if not has_glob(path):
        info = fs.get_file_info(path)
        return [pattern] if info.type != pafs.FileType.NotFound else []
    parts = path.split("/")
    fixed = []
    for part in parts:
        if has_glob(part):
            break
        fixed.append(part)
    root = "/".join(fixed) or "/"
    depth = len(parts) - len(fixed)
    recursive = "**" in path
    if fs.get_file_info(root).type != pafs.FileType.Directory:
        return []
    selector = pafs.FileSelector(root, recursive=recursive, allow_not_found=True)
    if not recursive and depth > 1:
        selector = pafs.FileSelector(root, recursive=True, allow_not_found=True)
    regex = _glob_regex(path)
    matches = []
    for info in fs.get_file_info(selector):
        if regex.fullmatch(info.path):
            matches.append(to_location(fs, info.path, pattern))
    return sorted(matches)


def _glob_regex(pattern: str) -> re.Pattern:
    out = []
    i = 0
    while i < len(pattern):
        if pattern.startswith("**/", i):
            out.append("(?:.*/)?")
            i += 3
        elif pattern.startswith("**", i):
            out.append(".*")
            i += 2
        elif pattern[i] == "*":
            out.append("[^/]*")
            i += 1
        elif pattern[i] == "?":
            out.append("[^/]")
            i += 1
        elif pattern[i] == "[":
            end = pattern.find("]", i + 1)
            if end == -1:
                out.append(re.escape("["))
                i += 1
            else:
                out.append(fnmatch.translate(pattern[i : end + 1])[4:-3])
                i = end + 1
        else:
            out.append(re.escape(pattern[i]))
            i += 1
    return re.compile("".join(out))


def is_dir(location: str) -> bool:
    fs, path = filesystem(location)
    return fs.get_file_info(path).type == pafs.FileType.Directory


def list_files(location: str, suffixes: Iterable[str] | None = None) -> list[str]:
    """Every file under a folder (recursively), sorted; hidden (``.``/``_``) names skipped."""
    fs, path = filesystem(location)
    out = []
    for info in fs.get_file_info(pafs.FileSelector(path, recursive=True)):
        if info.type != pafs.FileType.File:
            continue
        rel = info.path[len(path) :].lstrip("/")
        if any(part.startswith((".", "_")) for part in rel.split("/")):
            continue
        if suffixes is not None and not info.path.endswith(tuple(suffixes)):
            continue
        out.append(to_location(fs, info.path, location))
    return sorted(out)
