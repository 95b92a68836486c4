"""How a schema field is declared, and the walks over those declarations.

Every field of ``config.schema`` is made by ``setting``: its doc, whether it changes a cell's
numbers (the cache key walks that: ``numbers_of``), the key the sweep file gives it, and the
checks ``config.reader`` applies to a value the file gives (``CHECKS``). Imports nothing of
rayeval's.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from typing import Any, Iterator

TEXT = "text"     # ``numbers=TEXT``: changes the numbers of text tasks' cells only
_SAME = object()  # ``yaml=_SAME``: the sweep-file key is the field's name


def setting(doc: str, *, numbers: bool | str, default: Any = dataclasses.MISSING,
            default_factory: Any = dataclasses.MISSING, yaml: str | None | object = _SAME,
            sweep_default: bool = False, single_form: str | None = None,
            keyed_if_set: bool = False, **check: Any) -> Any:
    """A dataclass field with its declaration. ``numbers``: True when a different value gives
    a cell different stored results (its numbers, or the labels its rows carry), False when it
    does not (how fast, where, who is told), ``TEXT`` when only text tasks' cells change.
    ``sweep_default``: an evaluation key the sweep's top level may also give, as the default
    of every evaluation. ``single_form``: the key that gives it in the one-evaluation form.
    ``keyed_if_set``: left out of the key while None, so that adding the field did not
    change the keys of cells stored before it existed.
    ``check``: how ``config.reader`` validates a value the sweep file gives (see CHECKS)."""
    if numbers not in (True, False, TEXT):
        raise ValueError(f"numbers must be True, False or TEXT, got {numbers!r}")
    unknown = set(check) - set(CHECKS)
    if unknown:
        raise ValueError(f"unknown checks {sorted(unknown)}; see schema.CHECKS")
    meta = {"doc": doc, "numbers": numbers, "sweep_default": sweep_default,
            "single_form": single_form, "keyed_if_set": keyed_if_set, **check}
    if yaml is not _SAME:
        meta["yaml"] = yaml
    return dataclasses.field(default=default, default_factory=default_factory, metadata=meta)


# What a field may declare besides its type, read by ``config.reader`` (a value's rules written
# once, beside its doc): bounds ``minimum``/``maximum`` (inclusive), ``above``/``below``
# (exclusive); ``choices`` (``noun``: "unknown dtype ...", else "expected one of ...", ``hint``
# after them); ``expected``: what every wrong value is said to miss ("expected X, got Y"), ``fix``
# after it; lists: ``each`` (an item's message, by index), ``nonempty``; ``blank``: empty or
# blank strings allowed; ``location``: resolved against the sweep file's folder; ``callable``:
# a 'module:callable'; ``file_default``: the value when a required field's key is left out.
CHECKS = ("minimum", "maximum", "above", "below", "choices", "noun", "hint", "expected", "fix",
          "each", "nonempty", "blank", "location", "callable", "file_default")


def yaml_key(f: dataclasses.Field) -> str | None:
    """The sweep-file key of a field; None for an internal one."""
    return f.metadata.get("yaml", f.name)


def sweep_fields(cls) -> Iterator[tuple[str, dataclasses.Field]]:
    """(sweep-file key, field) of each field of ``cls`` the sweep file may give."""
    for f in dataclasses.fields(cls):
        if yaml_key(f) is not None:
            yield yaml_key(f), f


def keys(cls) -> set[str]:
    """The sweep-file keys of a section: what the loader accepts in its mapping."""
    return {key for key, _ in sweep_fields(cls)}


def section(cls, f: dataclasses.Field) -> tuple[type, bool] | None:
    """The schema dataclass a field of ``cls`` holds and whether it holds a tuple of them;
    None for a plain value."""
    hint = typing.get_type_hints(cls)[f.name]
    many = typing.get_origin(hint) is tuple
    args = typing.get_args(hint) if many or typing.get_origin(hint) in (
        typing.Union, types.UnionType) else (hint,)
    found = [a for a in args if dataclasses.is_dataclass(a) and isinstance(a, type)]
    return (found[0], many) if found else None


def numbers_of(value: Any, text: bool) -> Any:
    """The parts of a spec that change a cell's numbers, as plain JSON-able data: each
    dataclass walked field by field (nested ones and tuples of them too), keeping the fields
    declared ``numbers=True`` (and ``TEXT`` ones when ``text``). A field added to the schema
    is in every key that walks it: its declaration cannot be forgotten."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        out = {}
        for f in dataclasses.fields(value):
            flag = f.metadata["numbers"]
            if f.metadata.get("keyed_if_set") and getattr(value, f.name) is None:
                continue
            if flag is True or (flag == TEXT and text):
                out[f.name] = numbers_of(getattr(value, f.name), text)
        return out
    if isinstance(value, (tuple, list)):
        return [numbers_of(v, text) for v in value]
    if isinstance(value, dict):
        return {str(k): numbers_of(v, text) for k, v in value.items()}
    return value
