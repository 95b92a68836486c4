"""One generic reader: a sweep file's mappings into the schema's frozen dataclasses.

Every rule a single value follows is declared on its field in ``config.schema`` (its type, and
the checks ``schema.CHECKS`` lists: bounds, choices, a 'module:callable' form, a location);
this module walks those declarations, so a field added there is read, checked and named in
messages without a line written here. Rules between fields are ``plan.validation``'s.

Every error is one line naming the sweep file and the key path at fault (``dataset.target``,
``evals[1].bootstrap.confidence``). Base floor: it imports only ``errors`` and ``config``.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import types
import typing
from typing import Any, Callable, NoReturn

from rayeval.config import schema
from rayeval.errors import SpecError

_MISSING = object()


def show(value: Any) -> str:
    """A value as messages name it: ``3 (int)``, ``nothing``."""
    if value is None:
        return "nothing"
    return f"{value!r} ({type(value).__name__})"


def join(path: str, key: str) -> str:
    """The key path of ``key`` inside ``path`` ("" is the top level)."""
    return f"{path}.{key}" if path else key


def closest(word: str, options: set[str]) -> str | None:
    found = difflib.get_close_matches(word, sorted(options), n=1, cutoff=0.7)
    return found[0] if found else None


def did_you_mean(word: str, options) -> str:
    """``"; did you mean 'x'?"`` with the nearest of ``options`` to a misspelt ``word`` (a
    key, a metric, a factory's attribute), else ``""``: every unknown-name error's hint."""
    hint = closest(word, set(options))
    return f"; did you mean {hint!r}?" if hint else ""


@functools.lru_cache(maxsize=None)
def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def shape(cls: type, name: str) -> tuple[Any, bool]:
    """A field's type without its ``None`` (``int | None`` -> int) and whether it takes None;
    a union of several types (``int | float``) stays a union."""
    hint = _hints(cls)[name]
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        args = tuple(a for a in typing.get_args(hint) if a is not type(None))
        optional = len(args) < len(typing.get_args(hint))
        return (args[0] if len(args) == 1 else typing.Union[args]), optional
    return hint, False


def field_of(cls: type, name: str) -> dataclasses.Field:
    return next(f for f in dataclasses.fields(cls) if f.name == name)


def default_of(f: dataclasses.Field) -> Any:
    """A field's default (its factory called), the sweep file's default for a key the
    dataclass requires (``file_default``), or _MISSING."""
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return f.metadata.get("file_default", _MISSING)


def _is_section(hint: Any) -> bool:
    return dataclasses.is_dataclass(hint) and isinstance(hint, type)


class Reader:
    """Reads one sweep file (``source``, for messages); ``resolve`` turns a location the file
    gives into a resolved one (relative to the file's folder)."""

    def __init__(self, source: str, resolve: Callable[[str], str] = lambda p: p):
        self.source, self.resolve = source, resolve

    def fail(self, path: str, problem: str) -> NoReturn:
        raise SpecError(f"{self.source}: {path}: {problem}")

    def mapping(self, value: Any, path: str, allowed: set[str]) -> dict:
        """``value`` as a mapping whose keys are all in ``allowed``."""
        if not isinstance(value, dict):
            self.fail(path or "(top level)", f"expected a mapping, got {show(value)}" if path
                      else f"the sweep file must be a YAML mapping of keys, got {show(value)}")
        for key in value:
            if key not in allowed:
                hint = closest(str(key), allowed)
                self.fail(join(path, str(key)), "unknown key" + (
                    f"; did you mean {hint!r}?" if hint
                    else f"; allowed keys: {', '.join(sorted(allowed))}"))
        return value

    def section(self, cls: type, raw: Any, path: str, *, base: Any = None,
                extra: set[str] | frozenset = frozenset(), skip: set[str] | frozenset = frozenset(),
                required: set[str] | frozenset = frozenset()) -> dict[str, Any]:
        """The fields of ``cls`` a mapping gives, read and checked, by field name; keys left
        out take ``base``'s values (else the fields' defaults). ``extra``: more keys the
        mapping may hold (the caller reads them); ``skip``: fields the caller reads itself;
        ``required``: fields this mapping must give although they have a default."""
        m = self.mapping({} if raw is None else raw, path, schema.keys(cls) | set(extra))
        out = {}
        for key, f in schema.sweep_fields(cls):
            if f.name not in skip:
                default = getattr(base, f.name) if base is not None else _MISSING
                out[f.name] = self.field(cls, f.name, m, join(path, key), default=default,
                                         required=f.name in required)
        return out

    def build(self, cls: type, raw: Any, path: str, *, base: Any = None, **given: Any) -> Any:
        """An instance of ``cls`` from its mapping; ``given``: fields the caller read."""
        return cls(**self.section(cls, raw, path, base=base, skip=set(given)), **given)

    def field(self, cls: type, name: str, m: dict, path: str, *, default: Any = _MISSING,
              required: bool = False) -> Any:
        """Field ``name`` of ``cls`` from mapping ``m`` (at ``path``); left out or null, it is
        ``default`` (else the field's own); required without one."""
        f = field_of(cls, name)
        value = m.get(schema.yaml_key(f))
        if value is not None:
            return self.value(cls, f, value, path)
        if default is _MISSING:
            default = default_of(f)
        hint, _ = shape(cls, name)
        if _is_section(hint) and (default is _MISSING or default is None) and not required:
            return default if default is None else self.build(hint, {}, path)
        if required or default is _MISSING:
            self.fail(path, "missing required key")
        return default

    def value(self, cls: type, f: dataclasses.Field, value: Any, path: str) -> Any:
        """A value the sweep file gives for field ``f``, checked against its declaration."""
        hint, _ = shape(cls, f.name)
        if _is_section(hint):
            return self.build(hint, value, path)
        if typing.get_origin(hint) is tuple:
            item = typing.get_args(hint)[0]
            if typing.get_origin(item) is tuple:             # (name, amount) pairs
                return self._pairs(f, value, path)
            return self._list(f, value, path)
        if hint is dict:
            if not isinstance(value, dict) or not all(isinstance(k, str) for k in value):
                self.wrong(f, value, path, "a mapping")
            return dict(value)
        if hint is bool:
            if not isinstance(value, bool):
                self.wrong(f, value, path, "true or false")
            return value
        if hint in (int, float) or typing.get_args(hint) == (int, float):
            return self._number(f, hint, value, path)
        if hint is str:
            return self._string(f, value, path)
        return value                                          # Any: checked by its reader

    def wrong(self, f: dataclasses.Field, value: Any, path: str, expected: str) -> NoReturn:
        """'expected X, got Y': X the field's own ``expected`` if it declares one."""
        meta = f.metadata
        fix = f"; {meta['fix']}" if meta.get("fix") else ""
        self.fail(path, f"expected {meta.get('expected', expected)}, got {show(value)}{fix}")

    def _number(self, f: dataclasses.Field, hint: Any, value: Any, path: str) -> Any:
        whole = hint is int
        if isinstance(value, bool) or not isinstance(value, int if whole else (int, float)):
            self.wrong(f, value, path, "an integer" if whole else "a number")
        meta = f.metadata
        low = meta.get("minimum")
        if low is not None and value < low:
            if "expected" in meta:
                self.wrong(f, value, path, "")
            self.fail(path, f"must be at least {low}, got {value}")
        number = float(value) if hint is float else value
        above, below, top = meta.get("above"), meta.get("below"), meta.get("maximum")
        if ((above is not None and not number > above) or (below is not None and not number < below)
                or (top is not None and not number <= top)):
            if "expected" in meta:
                self.wrong(f, value, path, "")
            left = f"({above}" if above is not None else f"[{low}"
            right = f"{below})" if below is not None else f"{top}]"
            self.fail(path, f"must be in {left}, {right}, got {number}")
        return number

    def _string(self, f: dataclasses.Field, value: Any, path: str) -> str:
        meta = f.metadata
        choices = meta.get("choices")
        if choices is not None and meta.get("noun") is None and value not in choices:
            self.wrong(f, value, path, f"one of {', '.join(choices)}")
        if not isinstance(value, str):
            self.wrong(f, value, path, "a non-empty string")
        if not (meta.get("blank") or value.strip()):
            self.fail(path, f"expected a non-empty string, got {show(value)}")
        if choices is not None and value not in choices:
            hint = f" {meta['hint']}" if meta.get("hint") else ""
            self.fail(path, f"unknown {meta['noun']} {value!r}; choose one of: "
                            f"{', '.join(choices)}{hint}")
        if meta.get("callable"):
            module, _, attr = value.partition(":")
            if not module or not attr:
                self.fail(path, f"expected 'module:callable', got {value!r}")
        return self.resolve(value) if meta.get("location") else value

    def _list(self, f: dataclasses.Field, value: Any, path: str) -> tuple[str, ...]:
        """A list of strings; one string is a list of one."""
        meta = f.metadata
        items = [value] if isinstance(value, str) else value
        if not isinstance(items, list) or (meta.get("nonempty") and not items):
            self.wrong(f, items, path, "a list of non-empty strings")
        for i, item in enumerate(items):
            if not isinstance(item, str) or not (item if meta.get("blank") else item.strip()):
                if meta.get("each"):
                    self.fail(f"{path}[{i}]", f"expected {meta['each']}, got {show(item)}")
                self.wrong(f, items, path, "a list of non-empty strings")
        if meta.get("location"):
            return tuple(self.resolve(item) for item in items)
        return tuple(items)

    def _pairs(self, f: dataclasses.Field, value: Any, path: str) -> tuple:
        """A mapping of names to non-negative amounts, as sorted (name, float) pairs."""
        low = f.metadata.get("minimum", float("-inf"))
        if not isinstance(value, dict) or not all(
                isinstance(k, str) and isinstance(v, (int, float)) and not isinstance(v, bool)
                and v >= low for k, v in value.items()):
            self.wrong(f, value, path, "a mapping of names to numbers")
        return tuple(sorted((k, float(v)) for k, v in value.items()))
