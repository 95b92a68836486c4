"""Kinds of ``evals`` entry that a slice renders into evaluations: ``lm_eval:`` and
``lmms_eval:`` entries, registered by their slices (``rayeval.harness``, ``rayeval.lmms``) as a
plugin registers, so that the loader (``plan``) reads any of them without naming one.

An entry kind is registered under the key that marks its entries in a sweep file, which is also
the name of the task its evaluations run (an ``lm_eval:`` entry's evaluations run task
``lm_eval``): ``ENTRIES.add_lazy("lm_eval", "rayeval.harness.entries:LmEvalEntry",
instance=True)``. The object registered has

    library       the library named in messages ("lm-eval")
    title         the library's full name ("lm-evaluation-harness")
    evaluations(context, m, path, batch_size, bootstrap, samples) -> list[EvalSpec]
                  entry ``m`` at key path ``path`` rendered; a group's aggregates appended to
                  ``context.groups``
    coverage(include_path, pattern) -> list
                  optional: every task of the library's registry (``pattern``: those whose
                  names match) judged by the rules a run applies, ``harness.coverage.Verdict``
                  each (``rayeval tasks --check``)
    prepare(specs, force)
                  before a run (no Ray): what its evaluations ``specs`` read is in the store
                  and is what this process rendered (``force``: written again)
    shipment(specs) -> picklable     on the driver: what the workers need of this process's
    receive(shipped)                 rendering, sent with the plan through Ray; on a worker

The loader checks what every kind shares before it calls ``evaluations``: the entry gives no
``task``, ``dataset``, ``metrics`` or ``generation`` (they come from the library), nor another
kind's key.

Standard library and ``config`` only: the floor below every slice.
"""

from __future__ import annotations

from typing import Any

from rayeval.config import plugins
from rayeval.config.registry import Registry
from rayeval.config.schema import Sweep

ENTRIES: Registry[Any] = Registry("evaluation entry kind")


def kinds() -> Registry[Any]:
    """The entry kinds, with the built-in slices' registered (``plugins.load_builtins``)."""
    plugins.load_builtins()
    return ENTRIES


class EntryContext:
    """What the rendered entries of one sweep file share: the reader (``r``), the file's
    top-level mapping, the model, the group aggregates found so far, and a cache a kind keeps
    what it loads once per file in (a tokenizer)."""

    def __init__(self, r, top: dict, model):
        self.r, self.top, self.model = r, top, model
        self.groups: list = []
        self.cache: dict[str, Any] = {}

    @property
    def output(self) -> str:
        """The result store, which keeps the rendered requests (read when first needed, as
        a sweep without rendered entries reads it: after its evaluations)."""
        return self.r.field(Sweep, "output", self.top, "output")

    @property
    def checkpoints(self) -> tuple[str, ...]:
        return self.r.field(Sweep, "checkpoints", self.top, "checkpoints")


def _used(specs) -> dict[str, list]:
    """The evaluations among ``specs`` by the kind that rendered them (an EvalSpec holds its
    entry under the kind's key: ``spec.lm_eval``)."""
    found: dict[str, list] = {}
    specs = list(specs)
    for key in kinds().names():
        own = [s for s in specs if getattr(s, key, None) is not None]
        if own:
            found[key] = own
    return found


def prepare(specs, force: bool = False) -> None:
    """Each kind's ``prepare`` for the evaluations it rendered: before a run, without Ray."""
    for key, own in _used(specs).items():
        ENTRIES.get(key).prepare(own, force)


def shipments(specs) -> dict[str, Any]:
    """What each kind sends the workers for the evaluations it rendered (``receive``)."""
    return {key: ENTRIES.get(key).shipment(own) for key, own in _used(specs).items()}


def receive(shipped: dict[str, Any] | None) -> None:
    """On a worker: each kind takes what the driver sent it."""
    for key, what in (shipped or {}).items():
        kinds().get(key).receive(what)
