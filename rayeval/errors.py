"""The errors rayeval raises, in one tree, and the one place foreign errors become them.

    RayevalError                 base: bad input or a failed run; the CLI prints one line, no traceback
    ├── SpecError                the sweep file: YAML, unknown/missing/mistyped keys, bad values
    ├── DataError                the evaluation data set: missing, empty, bad columns or values
    ├── ModelError               the model factory: cannot be imported, called, or returns no Module
    ├── MetricError              a (custom) metric's code failed on a batch or on its states
    ├── CheckpointError          one checkpoint: missing, corrupt, unsafe, or not fitting the model
    ├── EngineError              a model.backend engine (vLLM) cannot start: the run ends, no cell fails
    ├── StoreError               the result store: cannot be read or written
    ├── RegistryError            a task, metric or layout name registered twice, or not registered
    ├── VersionError             an installed Ray, vLLM, transformers or torch outside the range
    │                            rayeval's private hooks into it were written for (compat.py)
    └── RunError                 the run itself: cluster start-up, worker failure, row-count mismatch
        └── WorkerGroupError     a rank died or stalled: the worker group restarts (recovery.max_restarts)

Every message says what is at fault, which thing, and how to fix it. Besides the message, an
error may carry structured fields (``RayevalError.FIELDS``: the sweep's key path, the location,
the row, the foreign error's type and line) for code that acts on them rather than on text.
Errors raised inside Ray workers cross process boundaries, so each class pickles with its
message, detail and fields (``__reduce__``).

Foreign errors (pyarrow, torch, transformers, Ray's Jobs client, ...) carry multi-line messages;
``reason(e)`` is the one line of such an error worth showing, and ``wrap(e, DataError, what,
...)`` is the rayeval error that says ``what: <that line>`` and keeps the foreign type and line
as fields.
"""

from __future__ import annotations

from typing import Any, TypeVar

E = TypeVar("E", bound="RayevalError")


class RayevalError(Exception):
    """Base of every error rayeval raises on purpose. ``detail``: the traceback of the user's
    code (factory, forward, transform, custom metric) that caused it, shown with ``--debug``.

    Optional fields, None when not known: ``key_path`` the sweep key at fault
    (``evals[0].dataset.path``), ``location`` the file, folder or URI at fault, ``row_id`` the
    data row at fault, ``cause`` the type name of the foreign error behind this one and
    ``reason`` that error's one meaningful line."""

    FIELDS: tuple[str, ...] = ("key_path", "location", "row_id", "cause", "reason")
    key_path: str | None = None
    location: str | None = None
    row_id: Any = None
    cause: str | None = None
    reason: str | None = None

    def __init__(self, message: str, detail: str | None = None, **fields: Any):
        super().__init__(message)
        self.message = message
        self.detail = detail
        unknown = sorted(set(fields) - set(self.FIELDS))
        if unknown:      # a typo in a field name is a bug here, not a silently lost field
            raise TypeError(f"{type(self).__name__} has no field {', '.join(unknown)} "
                            f"(fields: {', '.join(self.FIELDS)})")
        for name, value in fields.items():
            if value is not None:
                setattr(self, name, value)

    def fields(self) -> dict[str, Any]:
        """The structured fields that are set."""
        return {k: getattr(self, k) for k in self.FIELDS if getattr(self, k) is not None}

    def __reduce__(self):
        # The fields travel as state (restored by BaseException.__setstate__), so a subclass
        # with extra fields pickles without its own __reduce__.
        return (self.__class__, (self.message, self.detail), self.fields() or None)

    def __str__(self) -> str:
        return self.message


class SpecError(RayevalError):
    """The sweep file is malformed; the message names the key path."""


class DataError(RayevalError):
    """The evaluation data set cannot be used as the sweep describes."""


class ModelError(RayevalError):
    """The model factory cannot produce a torch.nn.Module."""


class MetricError(RayevalError):
    """A metric's own code raised (a custom metric's update, rows or compute)."""


class CheckpointError(RayevalError):
    """One checkpoint cannot be loaded into the model; fails its own cell only."""


class EngineError(RayevalError):
    """A model.backend engine (vLLM) cannot start: the whole run ends, no cell is failed."""


class StoreError(RayevalError):
    """The result store cannot be read or written."""


class RunError(RayevalError):
    """The evaluation run failed as a whole."""


class WorkerGroupError(RunError):
    """A rank of the worker group died or stalled; the group is restarted, budget permitting."""


# Its name until 2026-12-02 ("group" is also an lm-eval task group): still importable.
GroupError = WorkerGroupError


class RegistryError(RayevalError):
    """A name registered twice, or asked for and not registered (``kind``: "task", "checkpoint
    layout", ...; ``name``: the name)."""

    FIELDS = RayevalError.FIELDS + ("kind", "name")
    kind: str | None = None
    name: str | None = None


class VersionError(RayevalError):
    """An installed package's version is outside the range rayeval's private hooks into it
    were written for (``rayeval.compat.SUPPORTED``): ``package``, the installed ``version``
    and the ``supported`` range."""

    FIELDS = RayevalError.FIELDS + ("package", "version", "supported")
    package: str | None = None
    version: str | None = None
    supported: str | None = None


def traceback_of(error: BaseException) -> str:
    """The full traceback of a caught exception, as text (for ``RayevalError.detail``)."""
    import traceback

    return "".join(traceback.format_exception(type(error), error, error.__traceback__))


def line(text: str, *, last: bool = False) -> str:
    """The first (``last``: the last) non-blank line of a text, stripped; "" if none."""
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    return (lines[-1] if last else lines[0]) if lines else ""


def reason(error: BaseException, *, typed: bool = False, last: bool = False) -> str:
    """The one line of a foreign error worth showing: the first non-blank line of its message
    (``last``: the last one, where a library puts the root cause at the end), stripped; the
    type's name when the message is empty. ``typed``: prefixed with the type's name
    (``ArrowInvalid: ...``), for errors whose text alone does not say what failed."""
    shown = line(error.message if isinstance(error, RayevalError) else str(error), last=last)
    name = type(error).__name__
    if not shown:
        return name
    return f"{name}: {shown}" if typed else shown


def wrap(error: BaseException, cls: type[E], what: str, *, typed: bool = False,
         last: bool = False, sep: str = ": ", detail: str | None = None, **fields: Any) -> E:
    """The rayeval error for a foreign one: ``cls(what + sep + reason(error))`` with the foreign
    type and line kept as the ``cause`` and ``reason`` fields, and ``fields`` (key_path,
    location, ...). Raise it ``from None``: the foreign traceback is noise for bad input (pass
    ``detail=traceback_of(error)`` when it is the user's code that failed). ``sep=" "`` reads
    as a sentence with ``typed``: "f() raised ValueError: ..."."""
    line = reason(error, last=last)
    shown = reason(error, typed=typed, last=last)
    return cls(f"{what}{sep}{shown}", detail, cause=type(error).__name__, reason=line, **fields)
