"""The errors rayeval raises, in one tree.

    RayevalError                 base: bad input or a failed run; the CLI prints one line, no traceback
    ├── SpecError                the sweep file: YAML, unknown/missing/mistyped keys, bad values
    ├── DataError                the evaluation data set: missing, empty, bad columns or values
    ├── ModelError               the model factory: cannot be imported, called, or returns no Module
    ├── MetricError              a (custom) metric's code failed on a batch or on its states
    ├── CheckpointError          one checkpoint: missing, corrupt, unsafe, or not fitting the model
    ├── StoreError               the result store: cannot be read or written
    └── RunError                 the run itself: cluster start-up, worker failure, row-count mismatch
        └── GroupError           a rank died or stalled: the worker group restarts (recovery.max_restarts)

Every message says what is at fault, which thing, and how to fix it. Errors raised inside Ray
workers cross process boundaries, so each class pickles with its message (``__reduce__``).
"""

from __future__ import annotations


class RayevalError(Exception):
    """Base of every error rayeval raises on purpose. ``detail``: the traceback of the user's
    code (factory, forward, transform, custom metric) that caused it, shown with ``--debug``."""

    def __init__(self, message: str, detail: str | None = None):
        super().__init__(message)
        self.message = message
        self.detail = detail

    def __reduce__(self):
        return (self.__class__, (self.message, self.detail))

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


class StoreError(RayevalError):
    """The result store cannot be read or written."""


class RunError(RayevalError):
    """The evaluation run failed as a whole."""


class GroupError(RunError):
    """A rank of the worker group died or stalled; the group is restarted, budget permitting."""


def traceback_of(error: BaseException) -> str:
    """The full traceback of a caught exception, as text (for ``RayevalError.detail``)."""
    import traceback

    return "".join(traceback.format_exception(type(error), error, error.__traceback__))
