"""What became of one cell: the one object that crosses from rank 0 through the progress
tracker to the driver.

Its own module, importing nothing heavy: the tracker actor unpickles one for every finished
cell, and a class defined beside the plan made its first unpickling import torch (about 2 s in
which rank 0 waited, and the other ranks with it at their next sync point).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class CellOutcome:
    """What became of one cell; crosses from rank 0 through the tracker to the driver."""
    key: str
    checkpoint: str
    evaluation: str
    step: int | None
    error: str | None = None     # None: published
    detail: str | None = None    # the traceback of the user's code behind the error (--debug)
    values: tuple[tuple[str, float], ...] = ()
    rows: int = 0
    seconds: float = 0.0
    layout: str | None = None
    attempt: int = 1
    peak_rss_bytes: int = 0
    baseline_rss_bytes: int = 0
    loaded_rss_bytes: int = 0    # the peak right after the checkpoint was loaded (before passes)
    items_total: int | None = None   # a raced checkpoint's partial cell: rows of its N items
    stopped: str | None = None       # and why it stopped (execution.workers.race.Stopped)
    resumed: int = 0                 # rows a race's partial cell had scored (not scored again)

    @property
    def partial(self) -> bool:
        return self.items_total is not None

    @property
    def ok(self) -> bool:
        return self.error is None


def failure_lines(outcomes) -> list[tuple[str, str | None]]:
    """Each distinct error of the failed ``outcomes`` once, with the evaluations it failed when
    several share it, and its detail (the traceback for --debug): ``(line, detail)``. A
    checkpoint that cannot be loaded fails every evaluation of it with one error, which
    printed once per cell read as twice the fault on a two-evaluation sweep."""
    grouped: dict[str, list[CellOutcome]] = {}
    for o in outcomes:
        if not o.ok:
            grouped.setdefault(o.error, []).append(o)
    lines = []
    for error, cells in grouped.items():
        evaluations = list(dict.fromkeys(o.evaluation for o in cells))
        shared = f" (evaluations {', '.join(evaluations)})" if len(evaluations) > 1 else ""
        lines.append((error + shared, next((o.detail for o in cells if o.detail), None)))
    return lines
