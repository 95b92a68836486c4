"""Whatever watches a run, as callbacks of the run (Ray Train v2's ``execution/
callback.py`` is the model): the progress display, the experiment trackers' publisher (``reporting.trackers``),
``rayeval watch``'s messages. The driver and the lifecycle call the hooks; the watchers are
not threaded through them as parameters.

The contract, in the order the hooks come (every hook's default does nothing):

- ``on_plan(plan)``: once per plan, before any worker starts (``watch``: each poll's plan).
- per fit (one ``TorchTrainer.fit``, or one poll fed to ``watch``'s standing group):
  ``on_group_start()`` when a new worker group is being made (not for a poll that reuses
  ``watch``'s standing group); ``on_fit_start()``; then ``on_progress(snapshot, elapsed,
  final)`` about every 0.5 s, the last one with ``final=True``, and ``on_cell(outcome)`` once
  per finished cell, soon after its rows are in the store (only to callbacks whose
  ``wants_cells`` is true); ``on_fit_end()`` always, also when the fit fails or is
  interrupted; ``on_outcomes(outcomes)`` when the fit's outcomes are known (not after an
  error).
- ``on_end(error)``: exactly once, last, in the teardown (with SIGINT/SIGTERM held), after the
  worker group and the Ray this process started are gone; ``error`` is what ends the run, or
  None.

A hook that raises is a bug in the watcher and propagates, as any bug does.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Iterable

if TYPE_CHECKING:
    from rayeval.plan.cells import CellOutcome, Plan


class RunCallback:
    """A watcher of a run: override the hooks it needs."""

    @property
    def wants_cells(self) -> bool:
        """Whether ``on_cell`` is wanted: the driver reads the finished cells from the
        run ledger only for those who want them."""
        return False

    def on_plan(self, plan: Plan) -> None:
        pass

    def on_group_start(self) -> None:
        pass

    def on_fit_start(self) -> None:
        pass

    def on_progress(self, snapshot: dict, elapsed: float, final: bool) -> None:
        """``snapshot``: the run ledger's (``RunLedger.snapshot``); ``elapsed``: seconds since
        this fit began to be followed."""

    def on_cell(self, outcome: CellOutcome) -> None:
        pass

    def on_fit_end(self) -> None:
        pass

    def on_outcomes(self, outcomes: list[CellOutcome]) -> None:
        pass

    def on_end(self, error: BaseException | None) -> None:
        pass


class Callbacks(RunCallback):
    """Several callbacks as one, each hook called on every callback in the order given."""

    def __init__(self, callbacks: Iterable[RunCallback] = ()):
        self.callbacks = [c for c in callbacks if c is not None]

    @classmethod
    def of(cls, given) -> Callbacks:
        """``given`` as callbacks: a Callbacks as it is, one RunCallback, or several."""
        if isinstance(given, Callbacks):
            return given
        if given is None:
            return cls()
        if isinstance(given, RunCallback):
            return cls([given])
        return cls(given)

    def add(self, callback: RunCallback) -> None:
        self.callbacks.append(callback)

    @property
    def wants_cells(self) -> bool:
        return any(c.wants_cells for c in self.callbacks)

    def on_plan(self, plan) -> None:
        for c in self.callbacks:
            c.on_plan(plan)

    def on_group_start(self) -> None:
        for c in self.callbacks:
            c.on_group_start()

    def on_fit_start(self) -> None:
        for c in self.callbacks:
            c.on_fit_start()

    def on_progress(self, snapshot, elapsed, final) -> None:
        for c in self.callbacks:
            c.on_progress(snapshot, elapsed, final)

    def on_cell(self, outcome) -> None:
        for c in self.callbacks:
            if c.wants_cells:
                c.on_cell(outcome)

    def on_fit_end(self) -> None:
        """Every callback's, even when one raises (a display must stop its live bar); the
        first error is raised after."""
        first = None
        for c in self.callbacks:
            try:
                c.on_fit_end()
            except BaseException as e:      # noqa: BLE001 - raised below, after the others
                first = first or e
        if first is not None:
            raise first

    def on_outcomes(self, outcomes) -> None:
        for c in self.callbacks:
            c.on_outcomes(outcomes)

    def on_end(self, error) -> None:
        for c in self.callbacks:
            c.on_end(error)


class OnCell(RunCallback):
    """A plain function that takes each finished cell."""

    def __init__(self, fn: Callable[[CellOutcome], None]):
        self.fn = fn

    @property
    def wants_cells(self) -> bool:
        return True

    def on_cell(self, outcome) -> None:
        self.fn(outcome)
