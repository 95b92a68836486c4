"""The Weights & Biases tracker: a run per sweep (its id made from the sweep's name) or a given
one, every eval/* metric plotted against ``eval/step``, the leaderboard as a table. ``wandb``
is imported when the tracker opens."""

from __future__ import annotations

import hashlib
import re

from rayeval.config.schema import WandbTracker
from rayeval.reporting.tracker_sinks import (LIMIT_TAG, STEP_METRIC, SWEEP_TAG, TABLE, Point, Say,
                                             _Sink)


class WandbSink(_Sink):
    name = "wandb"

    def __init__(self, spec: WandbTracker, sweep: str, warn: Say):
        super().__init__(sweep, warn)
        self.spec = spec
        self.run = None
        self.mode = spec.mode

    def where(self) -> str:
        return f"(project {self.spec.project}, {self.mode or 'online'})"

    def open(self) -> bool:
        return self.guard(f"cannot open a run in project {self.spec.project}", self._open)

    def _open(self) -> None:
        import wandb

        self.run_id = self.spec.run_id or wandb_run_id(self.sweep)
        settings = wandb.Settings(console="off", silent=True, disable_git=True,
                                  save_code=False, x_disable_stats=True,
                                  x_disable_machine_info=True, init_timeout=60)
        self.run = wandb.init(
            project=self.spec.project, entity=self.spec.entity, id=self.run_id,
            resume="allow", mode=self.mode, reinit="create_new", settings=settings,
            # a training run keeps its own name; the sweep's run is named after the sweep
            **({} if self.spec.run_id else {"name": self.sweep, "job_type": "eval",
                                             "config": {SWEEP_TAG: self.sweep}}))
        self.mode = getattr(self.run.settings, "mode", None) or self.mode   # as W&B resolved it
        self.run.define_metric(STEP_METRIC)
        self.run.define_metric("eval/*", step_metric=STEP_METRIC)

    def _log(self, pts: list[Point]) -> None:
        by_step: dict[int, dict[str, float]] = {}
        for p in pts:
            by_step.setdefault(p.step, {})[p.key] = p.value
        for step in sorted(by_step):
            self.run.log({STEP_METRIC: step, **by_step[step]})
        self.values += sum(p.figure for p in pts)

    def _tag_limits(self, found: dict[str, str]) -> None:
        self.run.config.update({f"{LIMIT_TAG}/{e}": text for e, text in found.items()},
                               allow_val_change=True)

    def _table(self, columns: list[str], data: list[list]) -> None:
        import wandb

        self.run.log({TABLE: wandb.Table(columns=columns, data=data)})

    def _close(self) -> None:
        self.run.finish()
        self.run = None

    def _release(self) -> None:
        if self.run is not None:         # after a failure: let go of the run, quietly
            try:
                self.run.finish(exit_code=1)
            except Exception:            # noqa: BLE001 - it failed already once
                pass
            self.run = None


def wandb_run_id(sweep: str) -> str:
    """A sweep's own W&B run id: the same for every command, so each adds to the same run."""
    slug = re.sub(r"[^A-Za-z0-9_-]+", "-", sweep).strip("-")[:40] or "sweep"
    return f"rayeval-{slug}-{hashlib.sha256(sweep.encode()).hexdigest()[:8]}"
